"""Dynamic batching on and off: throughput and p50/p99 over gRPC (h2load) and HTTP JSON (wrk) at several
concurrencies.

Each model is served twice side by side by one `kiln serve`: as the demo configures it (``dynamic_batching { }``)
and as a copy named ``<model>_nobatch`` whose config has no dynamic batching (each request runs on its own). The
same verified request (one row, its answer computed by the direct engine) is sent to both.

Bars: on ``mlp`` at concurrency 16, batching gives at least 1.3x the throughput of no batching; at concurrency 1,
p99 with batching grows by no more than max_queue_delay (0 in the demo configs) plus 10%.

    python benchmarks/batching.py --models mlp,resnet50 --concurrency 1,8,16,32 \
        --output benchmarks/results/batching-<date>.json
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _common import Case, describe, header, int_list, str_list, table, verify_grpc, verify_http, write_outputs
from _loadgen import LoadResult, require_tools, run_h2load, run_wrk, tool_versions, wait_quiet

import kiln
from kiln.demo import build_demo_repository
from kiln.serve_process import KilnProcess, kiln_serve

MAX_QUEUE_DELAY_US = 0  # the demo configs use dynamic_batching { }, i.e. no added delay
Measure = Callable[[KilnProcess, Case, int, argparse.Namespace], LoadResult]


def build_repository(repo: Path, models: list[str]) -> None:
    """The demo repository plus a ``<model>_nobatch`` copy of each model without its dynamic_batching block."""
    build_demo_repository(repo, include_resnet50="resnet50" in models)
    for model in models:
        copy = repo / f"{model}_nobatch"
        shutil.copytree(repo / model, copy)
        config = (copy / "config.pbtxt").read_text()
        config = config.replace(f'name: "{model}"', f'name: "{model}_nobatch"')
        config = config.replace("dynamic_batching { }\n", "")
        if "dynamic_batching" in config:
            raise SystemExit(f"{model}: could not remove dynamic_batching from its config:\n{config}")
        (copy / "config.pbtxt").write_text(config)


def engine_case(repo: Path, model: str) -> Case:
    """One request row of the model's first input and the direct engine's answer to it."""
    rng = np.random.default_rng(7)
    with kiln.load(repo / model) as engine:
        spec = engine.inputs[0]
        x = rng.standard_normal((1, *spec.dims)).astype(np.float32)
        expected = dict(engine.infer({spec.name: x}))
    return Case(model, {spec.name: x}, {spec.name: spec.datatype}, expected)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,resnet50")
    parser.add_argument("--concurrency", default="1,8,16,32")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--max-wait-quiet", type=float, default=60.0, help="0: don't wait for a quiet machine")
    parser.add_argument("--protocols", default="grpc,http", help="grpc (h2load) and/or http (JSON, wrk)")
    parser.add_argument("--output", type=Path, default=None, help="JSON results (a .txt beside it gets the text)")
    args = parser.parse_args(argv)
    models, protocols, concurrencies = str_list(args.models), str_list(args.protocols), int_list(args.concurrency)
    require_tools(*(["h2load"] if "grpc" in protocols else []), *(["wrk"] if "http" in protocols else []))

    info = describe("kiln dynamic batching on vs off, one row per request", tools=tool_versions())
    print(header(info), flush=True)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-batching-") as tmp_name:
        tmp = Path(tmp_name)
        repo = tmp / "repo"
        build_repository(repo, models)
        with kiln_serve([repo], log_path=tmp / "kiln.log", ready_timeout_s=300) as server:
            for model in models:
                case = engine_case(repo, model)
                for protocol in protocols:
                    measure: Measure = _grpc if protocol == "grpc" else _http
                    for variant in (case, Case(f"{model}_nobatch", case.request, case.datatypes, case.expected)):
                        for c in concurrencies:
                            wait_quiet([server.process.pid], args.max_wait_quiet)
                            result = measure(server, variant, c, args)
                            print(f"{protocol:4s} {variant.model:18s} c={c:<3d} {result.line()}", flush=True)
                            results.append({"model": model, "protocol": protocol,
                                            "batching": variant.model == model, "result": result})
    text = header(info) + "\n" + report(results, models, protocols, concurrencies)
    print(text[len(header(info)):])
    write_outputs(args.output, {"machine": info, "args": vars(args), "results": results}, text)
    return 0


def _grpc(server: KilnProcess, case: Case, c: int, args: argparse.Namespace) -> LoadResult:
    message, response = verify_grpc(server.grpc_url, case)
    return run_h2load(f"http://{server.grpc_url}", message, c, args.duration, args.warmup,
                      expected_response_bytes=len(response), server_pids=[server.process.pid])


def _http(server: KilnProcess, case: Case, c: int, args: argparse.Namespace) -> LoadResult:
    body, headers = verify_http(server.http_url, case, binary=False)
    url = f"http://{server.http_url}/v2/models/{case.model}/infer"
    return run_wrk(url, body, headers, c, args.duration, args.warmup, server_pids=[server.process.pid])


def report(results: list[dict[str, Any]], models: list[str], protocols: list[str], concurrencies: list[int]) -> str:
    by: dict[tuple[str, str, bool, int], LoadResult] = {
        (r["model"], r["protocol"], r["batching"], r["result"].concurrency): r["result"] for r in results}
    rows = []
    for model in models:
        for protocol in protocols:
            for c in concurrencies:
                on, off = by[(model, protocol, True, c)], by[(model, protocol, False, c)]
                on_off = f"{on.rps / off.rps:.2f}x" if off.rps else "-"
                rows.append([model, protocol, c, off.rps, on.rps, on_off, off.p50_ms, on.p50_ms, off.p99_ms,
                             on.p99_ms])
    lines = [table(["model", "protocol", "conc", "req/s off", "req/s on", "on/off", "p50 off ms", "p50 on ms",
                    "p99 off ms", "p99 on ms"], rows, numeric_from=2)]
    if "mlp" in models and 16 in concurrencies and 1 in concurrencies:
        for protocol in protocols:
            off16 = by[("mlp", protocol, False, 16)].rps
            ratio = by[("mlp", protocol, True, 16)].rps / off16 if off16 else 0.0
            allowed = by[("mlp", protocol, False, 1)].p99_ms * 1.10 + MAX_QUEUE_DELAY_US / 1000
            p99 = by[("mlp", protocol, True, 1)].p99_ms
            lines += [f"bar 1 ({protocol}): mlp c=16 batching/no batching = {ratio:.2f}x (need >= 1.30): "
                      f"{'PASS' if ratio >= 1.3 else 'FAIL'}",
                      f"bar 2 ({protocol}): mlp c=1 p99 with batching {p99:.2f} ms <= {allowed:.2f} ms (no-batching "
                      f"p99 + 10% + max_queue_delay): {'PASS' if p99 <= allowed else 'FAIL'}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
