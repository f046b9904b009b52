"""Dynamic batching on and off: throughput and p50/p99 over gRPC (and HTTP JSON) at several concurrencies.

Each model is served twice side by side by one `kiln serve`: as the demo configures it (``dynamic_batching { }``)
and as a copy named ``<model>_nobatch`` whose config has no dynamic batching (each request runs on its own). The
same verified ModelInfer request is sent with h2load (one call in flight per connection).

Performance bar (issue: scheduling): on ``mlp`` at concurrency 16, batching gives at least 1.3x the throughput
of no batching; at concurrency 1, p99 with batching grows by no more than max_queue_delay plus 10%.

    .venv/bin/python benchmarks/batching.py --models mlp,resnet50 --concurrency 1,8,16,32 \
        --output benchmarks/results/batching-<date>.json
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    GRPC_INFER_PATH,
    PROJECT_PYTHON,
    LoadResult,
    ServerProcess,
    Tensor,
    check_outputs,
    command_line,
    ensure_tools,
    format_table,
    free_port,
    grpc_request,
    grpc_unary,
    header_lines,
    http_post,
    json_body,
    kiln_serve_cmd,
    machine_info,
    parse_grpc_response,
    parse_json_response,
    project_env,
    run_h2load,
    run_wrk,
    running,
    wait_quiet,
    write_json,
)

MAX_QUEUE_DELAY_US = 0  # the demo configs use dynamic_batching { }, i.e. no added delay


def build_repository(repo: Path, models: list[str]) -> None:
    import subprocess

    args = [str(PROJECT_PYTHON), "-m", "kiln.cli", "demo-repo", str(repo)]
    if "resnet50" in models:
        args.append("--resnet50")
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, timeout=600, env=project_env())
    for model in models:
        copy = repo / f"{model}_nobatch"
        shutil.copytree(repo / model, copy)
        config = (copy / "config.pbtxt").read_text()
        config = config.replace(f'name: "{model}"', f'name: "{model}_nobatch"')
        config = config.replace("dynamic_batching { }\n", "")
        if "dynamic_batching" in config:
            raise SystemExit(f"{model}: could not remove dynamic_batching from its config:\n{config}")
        (copy / "config.pbtxt").write_text(config)


def case(repo: Path, model: str) -> tuple[list[Tensor], dict[str, np.ndarray]]:
    """One request row and its expected output, computed in-process with the direct engine."""
    import kiln

    rng = np.random.default_rng(7)
    with kiln.load(repo / model) as engine:
        spec = engine.inputs[0]
        x = rng.standard_normal((1, *spec.dims)).astype(np.float32)
        expected = engine.infer({spec.name: x})
    return [Tensor(spec.name, "FP32", x)], expected


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,resnet50")
    parser.add_argument("--concurrency", default="1,8,16,32")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--max-wait-quiet", type=float, default=60.0)
    parser.add_argument("--protocols", default="grpc,http", help="grpc and/or http (JSON, wrk)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    protocols = [p for p in args.protocols.split(",") if p]
    concurrencies = [int(c) for c in args.concurrency.split(",") if c]

    ensure_tools()
    info = machine_info()
    info["command"] = command_line()
    for line in header_lines("kiln dynamic batching on vs off (gRPC, one row per request)", info):
        print(line, flush=True)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-batching-") as tmp_name:
        tmp = Path(tmp_name)
        repo = tmp / "repo"
        build_repository(repo, models)
        http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
        cmd = kiln_serve_cmd(repo, http_port, grpc_port, metrics_port)
        server = ServerProcess("kiln serve", cmd, tmp / "kiln.log", env=project_env())
        with running(server):
            server.wait_http_ready(http_port, timeout=300)
            pgid = server.proc.pid
            for model in models:
                inputs, expected = case(repo, model)
                for protocol in protocols:
                    for variant in (model, f"{model}_nobatch"):
                        measure = _grpc if protocol == "grpc" else _http
                        for c in concurrencies:
                            wait_quiet(pgid, args.max_wait_quiet)
                            result = measure(variant, inputs, expected, c, args, grpc_port, http_port, pgid)
                            print(f"{protocol:4s} {variant:18s} c={c:<3d} {result.rps:9,.1f} req/s  "
                                  f"p50 {result.p50_ms:8.2f} ms  p99 {result.p99_ms:8.2f} ms  errors {result.errors} "
                                  f"{result.notes}", flush=True)
                            results.append({"model": model, "protocol": protocol, "batching": variant == model,
                                            "result": result})
    for line in report(results, models, protocols, concurrencies):
        print(line)
    if args.output:
        write_json(args.output, {"machine": info, "results": results})
    return 0


def _grpc(variant: str, inputs: list[Tensor], expected: dict[str, np.ndarray], c: int, args: argparse.Namespace,
          grpc_port: int, http_port: int, pgid: int) -> LoadResult:
    message = grpc_request(variant, inputs)
    response = grpc_unary(grpc_port, GRPC_INFER_PATH, message, timeout=60)
    check_outputs(parse_grpc_response(response), expected, variant)
    return run_h2load(f"http://127.0.0.1:{grpc_port}", message, c, args.duration, args.warmup,
                      expected_response_bytes=len(response), server_pgid=pgid)


def _http(variant: str, inputs: list[Tensor], expected: dict[str, np.ndarray], c: int, args: argparse.Namespace,
          grpc_port: int, http_port: int, pgid: int) -> LoadResult:
    path = f"/v2/models/{variant}/infer"
    body, headers = json_body(inputs), {"Content-Type": "application/json"}
    status, _headers, answer = http_post(http_port, path, body, headers)
    if status != 200:
        raise AssertionError(f"{variant}: HTTP {status}: {answer[:300]!r}")
    check_outputs(parse_json_response(answer), expected, variant)
    url = f"http://127.0.0.1:{http_port}{path}"
    run_wrk(url, body, headers, c, args.warmup)
    return run_wrk(url, body, headers, c, args.duration, server_pgid=pgid)


def report(results: list[dict[str, Any]], models: list[str], protocols: list[str],
           concurrencies: list[int]) -> list[str]:
    by: dict[tuple[str, str, bool, int], LoadResult] = {
        (r["model"], r["protocol"], r["batching"], r["result"].concurrency): r["result"] for r in results}
    rows = []
    for model in models:
        for protocol in protocols:
            for c in concurrencies:
                on, off = by[(model, protocol, True, c)], by[(model, protocol, False, c)]
                ratio = f"{on.rps / off.rps:.2f}x" if off.rps else "-"
                rows.append([model, protocol, c, f"{off.rps:,.1f}", f"{on.rps:,.1f}", ratio, f"{off.p50_ms:.2f}",
                             f"{on.p50_ms:.2f}", f"{off.p99_ms:.2f}", f"{on.p99_ms:.2f}"])
    lines = ["", *format_table(["model", "protocol", "conc", "req/s off", "req/s on", "on/off", "p50 off ms",
                                "p50 on ms", "p99 off ms", "p99 on ms"], rows)]
    if "mlp" in models and 16 in concurrencies and 1 in concurrencies:
        for protocol in protocols:
            ratio = by[("mlp", protocol, True, 16)].rps / by[("mlp", protocol, False, 16)].rps
            allowed = by[("mlp", protocol, False, 1)].p99_ms * 1.10 + MAX_QUEUE_DELAY_US / 1000
            p99 = by[("mlp", protocol, True, 1)].p99_ms
            lines += ["", f"bar 1 ({protocol}): mlp c=16 batching/no batching = {ratio:.2f}x (need >= 1.30): "
                          f"{'PASS' if ratio >= 1.3 else 'FAIL'}",
                      f"bar 2 ({protocol}): mlp c=1 p99 with batching {p99:.2f} ms <= {allowed:.2f} ms (no-batching "
                      f"p99 + 10% + max_queue_delay): {'PASS' if p99 <= allowed else 'FAIL'}"]
    return lines


if __name__ == "__main__":
    sys.exit(main())
