"""The performance bar: kiln vs Seldon MLServer 1.7.1 on the demo ``mlp`` model, one row per request.

Same V2 JSON body and same load generator (wrk) for kiln HTTP vs MLServer REST (FastAPI); same serialized
``ModelInferRequest`` (``raw_input_contents``) and same load generator (h2load) for kiln gRPC vs MLServer gRPC.
MLServer runs a custom runtime (``benchmarks/mlserver_runtime/onnx_runtime.py``: one onnxruntime session, one
``session.run`` per request) on the very same ``model.onnx``, adaptive batching off, at ``parallel_workers`` 0 and
1; the faster of the two is the bar. kiln is measured with the demo repository as ``kiln demo-repo`` writes it
(its ``mlp`` config has ``dynamic_batching { }``) and, for reference, with that block removed.

MLServer gets its own venv (``benchmarks/.venv-mlserver``, created on first run with
``pip install mlserver==1.7.1 onnxruntime onnx numpy uvloop==0.21.0``; uvloop 0.22+ crashes MLServer's workers).

    .venv/bin/python benchmarks/mlserver_compare.py [--duration 10] [--concurrency 16] [--output results.json]
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
from pathlib import Path
from typing import Any

from _common import (
    BENCH_DIR,
    GRPC_INFER_PATH,
    LoadResult,
    ServerProcess,
    Tensor,
    build_demo_repo,
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
    kiln_serve_available,
    kiln_serve_cmd,
    machine_info,
    mlp_case,
    parse_grpc_response,
    parse_json_response,
    project_env,
    run_h2load,
    run_wrk,
    running,
    wait_quiet,
    write_json,
)

MLSERVER_VERSION = "1.7.1"
MLSERVER_VENV = BENCH_DIR / ".venv-mlserver"
MLSERVER_PIP = [f"mlserver=={MLSERVER_VERSION}", "onnxruntime", "onnx", "numpy", "uvloop==0.21.0"]
RUNTIME_FILE = BENCH_DIR / "mlserver_runtime" / "onnx_runtime.py"
MODEL = "mlp"

Payload = tuple[list[Tensor], dict[str, Any], bytes, bytes]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0, help="measurement window, seconds (default 10)")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up before each window, seconds (default 2)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    parser.add_argument("--workers", default="0,1", help="MLServer parallel_workers values to try (default 0,1)")
    parser.add_argument("--bar", type=float, default=2.5, help="required kiln/MLServer throughput ratio (2.5)")
    parser.add_argument("--kiln-variants", default="demo,nobatch,grpc-workers=1",
                        help="kiln configs: demo (as written by demo-repo), nobatch (dynamic_batching removed), "
                             "grpc-workers=N (demo, with kiln serve --grpc-workers N)")
    parser.add_argument("--skip-kiln", action="store_true", help="measure MLServer only")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds over all servers, interleaved; each figure is the median over rounds (default 3)")
    parser.add_argument("--max-wait-quiet", type=float, default=120.0,
                        help="before each window, wait up to this long for other processes to go idle (default 120)")
    parser.add_argument("--output", type=Path, default=None, help="write all results as JSON here")
    args = parser.parse_args()

    ensure_tools()
    python = ensure_mlserver_venv()
    info = machine_info(extra_packages=_venv_versions(python))
    info["command"] = command_line()
    for line in header_lines("kiln vs Seldon MLServer (mlp, one row per request)", info):
        print(line, flush=True)
    print(f"window {args.duration:g} s after {args.warmup:g} s warm-up; concurrency {args.concurrency}; "
          "wrk -t1 (HTTP/1.1 keep-alive), h2load -t1 -m1 (one call per connection in flight)\n", flush=True)

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-vs-mlserver-") as tmp_name:
        tmp = Path(tmp_name)
        repo = tmp / "kiln-repo"
        build_demo_repo(repo)
        inputs, expected = mlp_case(repo / MODEL / "1" / "model.onnx")
        payload: Payload = (inputs, expected, json_body(inputs), grpc_request(MODEL, inputs))
        variants: list[str] = []
        if not args.skip_kiln:
            ok, why = kiln_serve_available()
            if not ok:
                print(f"kiln serve is not available: {why}", file=sys.stderr)
                return 2
            variants = [v.strip() for v in args.kiln_variants.split(",") if v.strip()]
        # Rounds interleave the servers, so that a slow spell of the machine does not hit one server only.
        for n in range(args.rounds):
            print(f"-- round {n + 1} of {args.rounds}", flush=True)
            for workers in [int(w) for w in args.workers.split(",") if w.strip()]:
                rows.append({"round": n + 1, **_measure_mlserver(python, tmp / f"r{n}", repo, workers, payload,
                                                                 args)})
            for variant in variants:
                rows.append({"round": n + 1, **_measure_kiln(tmp / f"r{n}", repo, variant, payload, args)})

    report = _report(rows, args.bar)
    for line in report["lines"]:
        print(line)
    if args.output:
        write_json(args.output, {"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                                 "rows": rows, "verdict": report["verdict"]})
    return 0


# --------------------------------------------------------------------------------------------------------------


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


def _venv_versions(python: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m\nfor p in ('mlserver','fastapi','uvicorn','uvloop','grpcio','onnxruntime',"
            "'numpy'):\n    print(p, m.version(p))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout
    return {f"mlserver-venv:{name}": version for name, version in (ln.split() for ln in out.splitlines())}


def _measure_mlserver(python: Path, tmp: Path, repo: Path, workers: int, payload: Payload,
                      args: argparse.Namespace) -> dict[str, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
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
    server = ServerProcess(name, cmd, tmp / f"mlserver-pw{workers}.log", cwd=root, env=env)
    with running(server):
        ready_s = server.wait_http_ready(http_port, ("/v2/health/ready", f"/v2/models/{MODEL}/ready"), timeout=180)
        print(f"   ready after {ready_s:.1f} s", flush=True)
        row = _measure(name, http_port, grpc_port, payload, args, server.proc.pid)
    row.update({"server": "mlserver", "parallel_workers": workers, "ready_s": ready_s,
                "settings": settings, "model_settings": model_settings})
    return row


def _measure_kiln(tmp: Path, repo: Path, variant: str, payload: Payload, args: argparse.Namespace) -> dict[str, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
    extra: list[str] = []
    if variant == "demo":
        served = repo
    elif variant.startswith("grpc-workers="):
        served = repo
        extra = ["--grpc-workers", variant.partition("=")[2]]
    elif variant == "nobatch":
        served = tmp / "kiln-repo-nobatch"
        shutil.copytree(repo / MODEL, served / MODEL)
        config = served / MODEL / "config.pbtxt"
        text = config.read_text()
        if "dynamic_batching { }\n" not in text:
            raise SystemExit(f"unexpected demo config, cannot remove dynamic_batching:\n{text}")
        config.write_text(text.replace("dynamic_batching { }\n", ""))
    else:
        raise SystemExit(f"unknown kiln variant '{variant}' (expected demo, nobatch or grpc-workers=N)")
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    cmd = kiln_serve_cmd(served, http_port, grpc_port, metrics_port) + extra
    name = f"kiln serve ({variant})"
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    server = ServerProcess(name, cmd, tmp / f"kiln-{variant}.log", env=project_env())
    with running(server):
        ready_s = server.wait_http_ready(http_port, timeout=180)
        print(f"   ready after {ready_s:.1f} s", flush=True)
        row = _measure(name, http_port, grpc_port, payload, args, server.proc.pid)
    row.update({"server": "kiln", "variant": variant, "ready_s": ready_s,
                "config": (served / MODEL / "config.pbtxt").read_text()})
    return row


def _measure(name: str, http_port: int, grpc_port: int, payload: Payload, args: argparse.Namespace,
             pgid: int) -> dict[str, Any]:
    _inputs, expected, body, message = payload
    # Correctness first: the exact bytes the load generators will send must give the right answer.
    status, _headers, resp = http_post(http_port, f"/v2/models/{MODEL}/infer", body,
                                       {"Content-Type": "application/json"})
    if status != 200:
        raise RuntimeError(f"{name}: REST infer returned {status}: {resp[:500]!r}")
    check_outputs(parse_json_response(resp), expected, f"{name} REST")
    grpc_resp = grpc_unary(grpc_port, GRPC_INFER_PATH, message)
    check_outputs(parse_grpc_response(grpc_resp), expected, f"{name} gRPC")
    print("   verified REST and gRPC answers against the numpy reference", flush=True)

    url = f"http://127.0.0.1:{http_port}/v2/models/{MODEL}/infer"
    headers = {"Content-Type": "application/json"}
    wait_quiet(pgid, args.max_wait_quiet)
    run_wrk(url, body, headers, args.concurrency, args.warmup)
    rest = run_wrk(url, body, headers, args.concurrency, args.duration, server_pgid=pgid)
    print(f"   REST  {_fmt(rest)}", flush=True)
    wait_quiet(pgid, args.max_wait_quiet)
    grpc = run_h2load(f"http://127.0.0.1:{grpc_port}", message, args.concurrency, args.duration, args.warmup,
                      expected_response_bytes=len(grpc_resp), server_pgid=pgid)
    print(f"   gRPC  {_fmt(grpc)}", flush=True)
    return {"name": name, "rest": rest, "grpc": grpc, "rest_body_bytes": len(body),
            "grpc_request_bytes": len(message), "grpc_response_bytes": len(grpc_resp)}


def _fmt(r: LoadResult) -> str:
    extra = f"  [{r.notes}]" if r.notes else ""
    return (f"{r.rps:,.0f} req/s  p50 {r.p50_ms:.2f} ms  p99 {r.p99_ms:.2f} ms  ok {r.ok}  errors {r.errors}"
            f"  cpu server/loadgen/other {r.cpu_server or 0:.2f}/{r.cpu_loadgen or 0:.2f}/{r.cpu_other or 0:.2f}"
            f"{extra}")


def _report(rows: list[dict[str, Any]], bar: float) -> dict[str, Any]:
    lines = ["", "## Every window (req/s counts only correct answers; latency in ms)"]
    table = []
    for row in rows:
        for proto in ("rest", "grpc"):
            r: LoadResult = row[proto]
            table.append([row["round"], row["name"], _proto(proto), r.concurrency, r.rps, r.p50_ms, r.p99_ms, r.ok,
                          r.errors, f"{r.cpu_server or 0:.2f}", f"{r.cpu_loadgen or 0:.2f}", f"{r.cpu_other or 0:.2f}"])
    lines += format_table(["round", "server", "protocol", "conc", "req/s", "p50", "p99", "ok", "errors",
                           "cpu server", "cpu loadgen", "cpu other"], table)
    lines += ["cpu columns: average cores busy during the window (server process group incl. workers; load "
              "generator; all other processes on the machine)"]

    # Median over rounds per (server, protocol); a window with errors counts as 0 req/s.
    names = list(dict.fromkeys(r["name"] for r in rows))
    summary: dict[str, dict[str, Any]] = {}
    for name in names:
        mine = [r for r in rows if r["name"] == name]
        summary[name] = {"server": mine[0]["server"], "variant": mine[0].get("variant")}
        for proto in ("rest", "grpc"):
            values = [r[proto].rps if r[proto].errors == 0 else 0.0 for r in mine]
            p50s = [r[proto].p50_ms for r in mine]
            summary[name][proto] = {"median_rps": statistics.median(values), "all_rps": values,
                                    "median_p50_ms": statistics.median(p50s)}
    lines += ["", "## Median over rounds"]
    st = []
    for name, s in summary.items():
        for proto in ("rest", "grpc"):
            st.append([name, _proto(proto), s[proto]["median_rps"], s[proto]["median_p50_ms"],
                       " / ".join(f"{v:,.0f}" for v in s[proto]["all_rps"])])
    lines += format_table(["server", "protocol", "median req/s", "median p50 ms", "req/s per round"], st)

    verdict: dict[str, Any] = {"bar": bar, "summary": summary}
    mls = [n for n, s in summary.items() if s["server"] == "mlserver"]
    kilns = [n for n, s in summary.items() if s["server"] == "kiln"]
    if mls and kilns:
        lines += ["", f"## Ratios kiln / best MLServer configuration (medians; bar: >= {bar:g}x)"]
        vt = []
        headline_pass = True
        for proto, label in (("rest", "kiln HTTP JSON vs MLServer REST"), ("grpc", "kiln gRPC vs MLServer gRPC")):
            best = max(mls, key=lambda n: summary[n][proto]["median_rps"])
            best_rps = summary[best][proto]["median_rps"]
            for k in kilns:
                rps = summary[k][proto]["median_rps"]
                ratio = rps / best_rps if best_rps else float("inf")
                passed = ratio >= bar
                if k == kilns[0]:
                    headline_pass &= passed
                vt.append([label, k, f"{rps:,.0f}", best, f"{best_rps:,.0f}", f"{ratio:.2f}x",
                           "PASS" if passed else "FAIL"])
                verdict[f"{proto}:{k}"] = {"kiln_rps": rps, "mlserver_rps": best_rps, "mlserver": best,
                                           "ratio": ratio, "pass": passed}
        lines += format_table(["comparison", "kiln", "kiln req/s", "best MLServer", "MLServer req/s", "ratio",
                               "verdict"], vt)
        verdict["pass"] = headline_pass
        best_kiln = {proto: max(kilns, key=lambda k: summary[k][proto]["median_rps"]) for proto in ("rest", "grpc")}
        best_pass = all(verdict[f"{proto}:{k}"]["pass"] for proto, k in best_kiln.items())
        verdict["best"] = {"configs": best_kiln, "pass": best_pass}
        lines += ["", f"OVERALL ({kilns[0]} on both protocols): {'PASS' if headline_pass else 'FAIL'}",
                  f"BEST kiln configuration per protocol (HTTP: {best_kiln['rest']}, gRPC: {best_kiln['grpc']}): "
                  f"{'PASS' if best_pass else 'FAIL'}"]
    return {"lines": lines, "verdict": verdict}


def _proto(proto: str) -> str:
    return "HTTP JSON (wrk)" if proto == "rest" else "gRPC raw (h2load)"


if __name__ == "__main__":
    sys.exit(main())
