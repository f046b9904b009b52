"""Cold start of ``kiln serve``: from process spawn to ready, on the demo repository (simple, mlp; no resnet50).

Each run spawns ``kiln serve`` on fresh ports and polls, from two threads, every ``--interval`` seconds:

* HTTP: ``GET /v2/health/ready`` until it answers 200;
* gRPC: ``ServerReady`` (a new channel per attempt, so no reconnect back-off hides readiness) until ``ready``.

The clock starts just before ``subprocess.Popen``, so interpreter start-up, imports, model loading and binding
the ports all count. The repository is built before the first run (not timed). "Ready" for the bar is the later
of the two; the median over ``--runs`` runs (default 5) must be at most ``--bar`` seconds (default 3).

    .venv/bin/python benchmarks/cold_start.py [--runs 5] [--bar 3] [--output results.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import (
    HOST,
    ServerProcess,
    build_demo_repo,
    command_line,
    format_table,
    free_port,
    header_lines,
    http_get_status,
    kiln_serve_available,
    kiln_serve_cmd,
    machine_info,
    project_env,
    wait_quiet,
    write_json,
)

SERVER_READY = "/inference.GRPCInferenceService/ServerReady"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="number of cold starts (default 5)")
    parser.add_argument("--bar", type=float, default=3.0, help="median spawn-to-ready limit, seconds (default 3)")
    parser.add_argument("--interval", type=float, default=0.01, help="poll interval, seconds (default 0.01)")
    parser.add_argument("--timeout", type=float, default=60.0, help="give up on a run after this many seconds")
    parser.add_argument("--max-wait-quiet", type=float, default=60.0,
                        help="before each run, wait up to this long for other processes to go idle (default 60)")
    parser.add_argument("--output", type=Path, default=None, help="write all results as JSON here")
    args = parser.parse_args()

    info = machine_info()
    info["command"] = command_line()
    for line in header_lines("kiln serve cold start (demo repository: simple, mlp)", info):
        print(line, flush=True)
    ok, why = kiln_serve_available()
    if not ok:
        print(f"kiln serve is not available: {why}", file=sys.stderr)
        return 2

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-cold-") as tmp_name:
        tmp = Path(tmp_name)
        repo = tmp / "repo"
        build_demo_repo(repo)
        print(f"repository: {repo} ({', '.join(sorted(p.name for p in repo.iterdir()))})")
        for i in range(args.runs):
            wait_quiet(None, args.max_wait_quiet)
            run = _one_run(tmp, repo, i, args)
            runs.append(run)
            print(f"run {i + 1}: HTTP ready {run['http_s']:.3f} s, gRPC ServerReady {run['grpc_s']:.3f} s, "
                  f"both {run['ready_s']:.3f} s, shutdown {run['stop_s']:.2f} s", flush=True)
            if run["first_http_status"] not in (None, 200):
                print(f"       (first HTTP answer was {run['first_http_status']} before it turned 200)")

    rows = [[i + 1, r["http_s"], r["grpc_s"], r["ready_s"]] for i, r in enumerate(runs)]
    med = {k: statistics.median(r[k] for r in runs) for k in ("http_s", "grpc_s", "ready_s")}
    rows.append(["median", med["http_s"], med["grpc_s"], med["ready_s"]])
    passed = med["ready_s"] <= args.bar
    lines = ["", "## Spawn to ready, seconds"]
    lines += format_table(["run", "HTTP /v2/health/ready 200", "gRPC ServerReady", "both ready"], rows)
    lines += ["", f"median spawn-to-ready {med['ready_s']:.3f} s vs bar {args.bar:g} s: {'PASS' if passed else 'FAIL'}"]
    for line in lines:
        print(line)
    if args.output:
        write_json(args.output, {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                                 "median": med, "bar_s": args.bar, "pass": passed})
    return 0


def _one_run(tmp: Path, repo: Path, index: int, args: argparse.Namespace) -> dict[str, Any]:
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    cmd = kiln_serve_cmd(repo, http_port, grpc_port, metrics_port)
    found: dict[str, Any] = {"first_http_status": None}
    env = project_env()
    t0 = time.perf_counter()
    server = ServerProcess("kiln serve", cmd, tmp / f"run{index}.log", env=env)
    server.started = t0
    deadline = t0 + args.timeout

    def poll_http() -> None:
        while time.perf_counter() < deadline and server.proc.poll() is None:
            status = http_get_status(http_port, "/v2/health/ready", timeout=1.0)
            if status is not None and found["first_http_status"] is None:
                found["first_http_status"] = status
            if status == 200:
                found["http_s"] = time.perf_counter() - t0
                return
            time.sleep(args.interval)

    def poll_grpc() -> None:
        while time.perf_counter() < deadline and server.proc.poll() is None:
            if _grpc_server_ready(grpc_port):
                found["grpc_s"] = time.perf_counter() - t0
                return
            time.sleep(args.interval)

    threads = [threading.Thread(target=poll_http, daemon=True), threading.Thread(target=poll_grpc, daemon=True)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=args.timeout + 5)
        if "http_s" not in found or "grpc_s" not in found:
            raise RuntimeError(f"run {index + 1}: not ready within {args.timeout:g} s (found {found}); log:\n"
                               f"{server.log_tail()}")
    finally:
        s0 = time.perf_counter()
        server.stop()
        found["stop_s"] = time.perf_counter() - s0
        found["exit_code"] = server.proc.returncode
    found["ready_s"] = max(found["http_s"], found["grpc_s"])
    found["command"] = " ".join(cmd)
    return found


def _grpc_server_ready(port: int) -> bool:
    import grpc
    from tritonclient.grpc import service_pb2 as pb

    channel = grpc.insecure_channel(f"{HOST}:{port}")
    try:
        call = channel.unary_unary(SERVER_READY, request_serializer=pb.ServerReadyRequest.SerializeToString,
                                   response_deserializer=pb.ServerReadyResponse.FromString)
        return bool(call(pb.ServerReadyRequest(), timeout=0.5).ready)
    except grpc.RpcError:
        return False
    finally:
        channel.close()


if __name__ == "__main__":
    sys.exit(main())
