"""The performance bar: kiln vs Seldon MLServer 1.7.1 on the demo ``mlp`` model, one row per request.

Same V2 JSON body and same load generator (wrk) for kiln HTTP vs MLServer REST (FastAPI); same serialized
``ModelInferRequest`` (``raw_input_contents``) and same load generator (h2load) for kiln gRPC vs MLServer gRPC.
MLServer runs a custom runtime (``benchmarks/mlserver_runtime/onnx_runtime.py``: one onnxruntime session, one
``session.run`` per request) on the very same ``model.onnx``, adaptive batching off, at each ``--workers`` value of
``parallel_workers``; the fastest is the bar. kiln is measured as ``kiln demo-repo`` writes the model (``mlp`` has
``dynamic_batching { }``) and in the ``--kiln-variants`` given. Rounds interleave the servers, so that a slow spell
of a shared machine does not hit one server only; each figure is the median over rounds.

MLServer gets its own venv (``benchmarks/.venv-mlserver``, created on first use with
``pip install mlserver==1.7.1 onnxruntime onnx numpy uvloop==0.21.0``; uvloop 0.22+ crashes MLServer's workers).
``--workers ''`` measures kiln alone (no MLServer venv needed).

    python benchmarks/mlserver_compare.py [--duration 10] [--concurrency 16] [--rounds 3] [--output results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import (
    BENCH_DIR,
    Case,
    describe,
    header,
    int_list,
    mlp_case,
    spawned,
    str_list,
    table,
    verify_grpc,
    verify_http,
    wait_http_ok,
    write_outputs,
)
from _loadgen import LoadResult, require_tools, run_h2load, run_wrk, tool_versions, wait_quiet

from kiln.demo import build_demo_repository
from kiln.serve_process import free_port, kiln_serve

MLSERVER_VERSION = "1.7.1"
MLSERVER_VENV = BENCH_DIR / ".venv-mlserver"
MLSERVER_PIP = [f"mlserver=={MLSERVER_VERSION}", "onnxruntime", "onnx", "numpy", "uvloop==0.21.0"]
RUNTIME_FILE = BENCH_DIR / "mlserver_runtime" / "onnx_runtime.py"
MODEL = "mlp"
PROTOCOLS = {"rest": "HTTP JSON (wrk)", "grpc": "gRPC raw (h2load)"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0, help="measurement window, seconds (default 10)")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up before each window, seconds (default 2)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    parser.add_argument("--workers", default="0,1", help="MLServer parallel_workers values (default 0,1; '' none)")
    parser.add_argument("--bar", type=float, default=2.5, help="required kiln/MLServer throughput ratio (2.5)")
    parser.add_argument("--kiln-variants", default="demo,nobatch,grpc-workers=1",
                        help="kiln configs: demo (as written by demo-repo), nobatch (dynamic_batching removed), "
                             "grpc-workers=N (demo, with kiln serve --grpc-workers N)")
    parser.add_argument("--skip-kiln", action="store_true", help="measure MLServer only")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all servers, interleaved (default 3)")
    parser.add_argument("--max-wait-quiet", type=float, default=120.0,
                        help="before each window, wait up to this long for other processes to go idle (0: don't)")
    parser.add_argument("--output", type=Path, default=None, help="JSON results (a .txt beside it gets the text)")
    args = parser.parse_args(argv)
    workers = int_list(args.workers)
    variants = [] if args.skip_kiln else str_list(args.kiln_variants)
    require_tools("wrk", "h2load")
    python = ensure_mlserver_venv() if workers else None

    info = describe("kiln vs Seldon MLServer (mlp, one row per request)", tools=tool_versions(),
                    mlserver_venv=_venv_versions(python) if python else "-",
                    settings=f"window {args.duration:g} s after {args.warmup:g} s warm-up; concurrency "
                             f"{args.concurrency}; wrk -t1, h2load -t1 -m1")
    print(header(info), flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-vs-mlserver-") as tmp_name:
        tmp = Path(tmp_name)
        repo = tmp / "kiln-repo"
        build_demo_repository(repo)
        case = mlp_case(repo / MODEL / "1" / "model.onnx")
        for n in range(args.rounds):
            print(f"-- round {n + 1} of {args.rounds}", flush=True)
            round_dir = tmp / f"r{n}"
            round_dir.mkdir()
            for count in workers:
                assert python is not None
                rows.append({"round": n + 1, **_measure_mlserver(python, round_dir, repo, count, case, args)})
            for variant in variants:
                rows.append({"round": n + 1, **_measure_kiln(round_dir, repo, variant, case, args)})
    text = header(info) + "\n" + _report(rows, args.bar)
    print(text[len(header(info)):])
    write_outputs(args.output, {"machine": info, "args": vars(args), "rows": rows}, text)
    return 0


def ensure_mlserver_venv() -> Path:
    """Create ``benchmarks/.venv-mlserver`` with MLServer 1.7.1 unless it already has it; return its python."""
    python = MLSERVER_VENV / "bin" / "python"
    if python.is_file():
        probe = subprocess.run([str(python), "-c", "import mlserver, onnxruntime, uvloop; print(mlserver.__version__,"
                                " uvloop.__version__)"], capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.split() == [MLSERVER_VERSION, "0.21.0"]:
            return python
    print(f"creating {MLSERVER_VENV} with: pip install {' '.join(MLSERVER_PIP)}", flush=True)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--clear", str(MLSERVER_VENV)], check=True, timeout=300)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *MLSERVER_PIP], check=True, timeout=1800)
    return python


def _venv_versions(python: Path) -> str:
    code = ("import importlib.metadata as m\nfor p in ('mlserver','fastapi','uvicorn','uvloop','grpcio','onnxruntime',"
            "'numpy'):\n    print(p, m.version(p))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout
    return ", ".join(out.splitlines())


def _measure_mlserver(python: Path, tmp: Path, repo: Path, workers: int, case: Case,
                      args: argparse.Namespace) -> dict[str, Any]:
    root = tmp / f"mlserver-pw{workers}"
    model_dir = root / "models" / MODEL
    model_dir.mkdir(parents=True)
    shutil.copy(repo / MODEL / "1" / "model.onnx", model_dir / "model.onnx")
    shutil.copy(RUNTIME_FILE, model_dir / "onnx_runtime.py")
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    settings = {"debug": False, "host": "127.0.0.1", "http_port": http_port, "grpc_port": grpc_port,
                "metrics_port": metrics_port, "parallel_workers": workers, "load_models_at_startup": True}
    model_settings = {
        "name": MODEL,
        "implementation": "onnx_runtime.OnnxRuntimeModel",
        # Adaptive batching off (MLServer's default, written out): max_batch_size 0, max_batch_time 0.
        "max_batch_size": 0,
        "max_batch_time": 0.0,
        "parameters": {"uri": "./model.onnx", "version": "1"},
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 64]}],
        "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 10]}],
    }
    (root / "settings.json").write_text(json.dumps(settings, indent=2))
    (model_dir / "model-settings.json").write_text(json.dumps(model_settings, indent=2))
    name = f"MLServer {MLSERVER_VERSION} parallel_workers={workers}"
    cmd = [str(python.parent / "mlserver"), "start", str(root)]
    env = {**os.environ, "PATH": f"{python.parent}:{os.environ.get('PATH', '')}"}
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    log = tmp / f"mlserver-pw{workers}.log"
    http_url, grpc_url = f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
    with spawned(cmd, log, cwd=root, env=env) as process:
        wait_http_ok(http_url, ("/v2/health/ready", f"/v2/models/{MODEL}/ready"), process, log)
        row = _measure(name, http_url, grpc_url, [process.pid], case, args)
    return {**row, "server": "mlserver", "parallel_workers": workers, "settings": settings,
            "model_settings": model_settings}


def _measure_kiln(tmp: Path, repo: Path, variant: str, case: Case, args: argparse.Namespace) -> dict[str, Any]:
    extra: list[str] = []
    served = repo
    if variant.startswith("grpc-workers="):
        extra = ["--grpc-workers", variant.partition("=")[2]]
    elif variant == "nobatch":
        served = tmp / "kiln-repo-nobatch"
        shutil.copytree(repo / MODEL, served / MODEL)
        config = served / MODEL / "config.pbtxt"
        text = config.read_text()
        if "dynamic_batching { }\n" not in text:
            raise SystemExit(f"unexpected demo config, cannot remove dynamic_batching:\n{text}")
        config.write_text(text.replace("dynamic_batching { }\n", ""))
    elif variant != "demo":
        raise SystemExit(f"unknown kiln variant '{variant}' (expected demo, nobatch or grpc-workers=N)")
    name = f"kiln serve ({variant})"
    print(f"== {name}", flush=True)
    with kiln_serve([served], *extra, log_path=tmp / f"kiln-{variant}.log", ready_timeout_s=180) as server:
        row = _measure(name, server.http_url, server.grpc_url, [server.process.pid], case, args)
    return {**row, "server": "kiln", "variant": variant, "config": (served / MODEL / "config.pbtxt").read_text()}


def _measure(name: str, http_url: str, grpc_url: str, pids: list[int], case: Case,
             args: argparse.Namespace) -> dict[str, Any]:
    # Correctness first: the exact bytes the load generators will send must give the right answer.
    body, headers = verify_http(http_url, case, binary=False)
    message, response = verify_grpc(grpc_url, case)
    print("   verified REST and gRPC answers against the numpy reference", flush=True)
    url = f"http://{http_url}/v2/models/{MODEL}/infer"
    wait_quiet(pids, args.max_wait_quiet)
    rest = run_wrk(url, body, headers, args.concurrency, args.duration, args.warmup, server_pids=pids)
    print(f"   REST  {rest.line()}", flush=True)
    wait_quiet(pids, args.max_wait_quiet)
    grpc = run_h2load(f"http://{grpc_url}", message, args.concurrency, args.duration, args.warmup,
                      expected_response_bytes=len(response), server_pids=pids)
    print(f"   gRPC  {grpc.line()}", flush=True)
    return {"name": name, "rest": rest, "grpc": grpc, "rest_body_bytes": len(body),
            "grpc_request_bytes": len(message), "grpc_response_bytes": len(response)}


def _report(rows: list[dict[str, Any]], bar: float) -> str:
    windows = []
    for row in rows:
        for proto in PROTOCOLS:
            r: LoadResult = row[proto]
            windows.append([row["round"], row["name"], PROTOCOLS[proto], r.concurrency, r.rps, r.p50_ms, r.p99_ms,
                            r.ok, r.errors, f"{r.cpu_server or 0:.2f}", f"{r.cpu_loadgen or 0:.2f}",
                            f"{r.cpu_other or 0:.2f}"])
    parts = ["## Every window (req/s counts only correct answers; latency in ms)\n",
             table(["round", "server", "protocol", "conc", "req/s", "p50", "p99", "ok", "errors", "cpu server",
                    "cpu loadgen", "cpu other"], windows, numeric_from=3),
             "cpu columns: average cores busy during the window (server processes incl. workers; load generator; "
             "all other processes on the machine)\n"]
    summary = _medians(rows)
    parts += ["## Median over rounds (a window with errors counts as 0 req/s)\n",
              table(["server", "protocol", "median req/s", "median p50 ms", "req/s per round"],
                    [[name, PROTOCOLS[proto], s[proto]["median_rps"], s[proto]["median_p50_ms"],
                      " / ".join(f"{v:,.0f}" for v in s[proto]["all_rps"])]
                     for name, s in summary.items() for proto in PROTOCOLS], numeric_from=2)]
    parts += _ratios(summary, bar)
    return "\n".join(parts)


def _medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per server: its kind, and per protocol the median req/s and p50 over rounds."""
    summary: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["name"] for r in rows):
        mine = [r for r in rows if r["name"] == name]
        summary[name] = {"server": mine[0]["server"]}
        for proto in PROTOCOLS:
            values = [r[proto].rps if r[proto].errors == 0 else 0.0 for r in mine]
            summary[name][proto] = {"median_rps": statistics.median(values), "all_rps": values,
                                    "median_p50_ms": statistics.median(r[proto].p50_ms for r in mine)}
    return summary


def _ratios(summary: dict[str, dict[str, Any]], bar: float) -> list[str]:
    mls = [n for n, s in summary.items() if s["server"] == "mlserver"]
    kilns = [n for n, s in summary.items() if s["server"] == "kiln"]
    if not mls or not kilns:
        return []
    rows = []
    for proto, label in (("rest", "kiln HTTP JSON vs MLServer REST"), ("grpc", "kiln gRPC vs MLServer gRPC")):
        best = max(mls, key=lambda n: float(summary[n][proto]["median_rps"]))
        best_rps = summary[best][proto]["median_rps"]
        for k in kilns:
            rps = summary[k][proto]["median_rps"]
            ratio = rps / best_rps if best_rps else float("inf")
            rows.append([label, k, rps, best, best_rps, f"{ratio:.2f}x", "PASS" if ratio >= bar else "FAIL"])
    return [f"## Ratios kiln / best MLServer configuration (medians; bar: >= {bar:g}x)\n",
            table(["comparison", "kiln", "kiln req/s", "best MLServer", "MLServer req/s", "ratio", "verdict"], rows,
                  numeric_from=2)]


if __name__ == "__main__":
    sys.exit(main())
