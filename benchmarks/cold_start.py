"""Cold start of ``kiln serve``: from process spawn to ready, on the demo repository (no resnet50).

Each run spawns ``kiln serve`` on fresh ports and polls, from two threads, every ``--interval`` seconds:

* HTTP: ``GET /v2/health/ready`` until it answers 200;
* gRPC: ``ServerReady`` (a new channel per attempt, so no reconnect back-off hides readiness) until ``ready``.

The clock starts just before the process is spawned, so interpreter start-up, imports, model loading and binding
the ports all count. The repository is built before the first run (not timed). "Ready" for the bar is the later
of the two; the median over ``--runs`` runs (default 5) must be at most ``--bar`` seconds (default 3).

    python benchmarks/cold_start.py [--runs 5] [--bar 3] [--output results.json]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import describe, header, kiln_serve_command, log_tail, table, write_outputs
from _loadgen import wait_quiet

from kiln.demo import build_demo_repository
from kiln.serve_process import free_port, stop

SERVER_READY = "/inference.GRPCInferenceService/ServerReady"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="number of cold starts (default 5)")
    parser.add_argument("--bar", type=float, default=3.0, help="median spawn-to-ready limit, seconds (default 3)")
    parser.add_argument("--interval", type=float, default=0.01, help="poll interval, seconds (default 0.01)")
    parser.add_argument("--timeout", type=float, default=60.0, help="give up on a run after this many seconds")
    parser.add_argument("--max-wait-quiet", type=float, default=60.0,
                        help="before each run, wait up to this long for other processes to go idle (0: don't)")
    parser.add_argument("--output", type=Path, default=None, help="JSON results (a .txt beside it gets the text)")
    args = parser.parse_args(argv)

    info = describe("kiln serve cold start (demo repository, no resnet50)")
    print(header(info), flush=True)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-cold-") as tmp_name:
        tmp = Path(tmp_name)
        repo = tmp / "repo"
        build_demo_repository(repo)
        print(f"repository: {repo} ({', '.join(sorted(p.name for p in repo.iterdir()))})")
        for i in range(args.runs):
            wait_quiet(None, args.max_wait_quiet)
            run = _one_run(tmp, repo, i, args)
            runs.append(run)
            print(f"run {i + 1}: HTTP ready {run['http_s']:.3f} s, gRPC ServerReady {run['grpc_s']:.3f} s, "
                  f"both {run['ready_s']:.3f} s, shutdown {run['stop_s']:.2f} s", flush=True)
            if run["first_http_status"] not in (None, 200):
                print(f"       (first HTTP answer was {run['first_http_status']} before it turned 200)")

    rows: list[list[object]] = [[i + 1, r["http_s"], r["grpc_s"], r["ready_s"]] for i, r in enumerate(runs)]
    med = {k: statistics.median(r[k] for r in runs) for k in ("http_s", "grpc_s", "ready_s")}
    rows.append(["median", med["http_s"], med["grpc_s"], med["ready_s"]])
    passed = med["ready_s"] <= args.bar
    text = (header(info) + "\n## Spawn to ready, seconds\n\n"
            + table(["run", "HTTP /v2/health/ready 200", "gRPC ServerReady", "both ready"], rows)
            + f"\nmedian spawn-to-ready {med['ready_s']:.3f} s vs bar {args.bar:g} s: {'PASS' if passed else 'FAIL'}\n")
    print(text[len(header(info)):])
    write_outputs(args.output, {"machine": info, "args": vars(args), "runs": runs, "median": med,
                                "bar_s": args.bar, "pass": passed}, text)
    return 0


def _one_run(tmp: Path, repo: Path, index: int, args: argparse.Namespace) -> dict[str, Any]:
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    cmd = kiln_serve_command(repo, http_port, grpc_port, metrics_port)
    found: dict[str, Any] = {"first_http_status": None}
    log_path = tmp / f"run{index}.log"
    with open(log_path, "wb") as log:
        t0 = time.perf_counter()
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = t0 + args.timeout

        def poll_http() -> None:
            while time.perf_counter() < deadline and process.poll() is None:
                status = _http_status(f"http://127.0.0.1:{http_port}/v2/health/ready")
                if status is not None and found["first_http_status"] is None:
                    found["first_http_status"] = status
                if status == 200:
                    found["http_s"] = time.perf_counter() - t0
                    return
                time.sleep(args.interval)

        def poll_grpc() -> None:
            while time.perf_counter() < deadline and process.poll() is None:
                if _grpc_server_ready(f"127.0.0.1:{grpc_port}"):
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
                                   f"{log_tail(log_path)}")
        finally:
            s0 = time.perf_counter()
            stop(process)
            found["stop_s"] = time.perf_counter() - s0
            found["exit_code"] = process.returncode
    found["ready_s"] = max(found["http_s"], found["grpc_s"])
    found["command"] = " ".join(cmd)
    return found


def _http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return None


def _grpc_server_ready(grpc_url: str) -> bool:
    import grpc

    from kiln.v2._generated import grpc_service_pb2 as pb

    channel = grpc.insecure_channel(grpc_url)
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
