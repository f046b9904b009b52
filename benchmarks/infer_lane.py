"""The HTTP infer lane on and off, side by side: `kiln serve --http-workers N` against the device stand-in.

The stand-in of served_ceiling.py (one ResNet-50-shaped model: a 301 KB FP16 image in, 1000 FP32 values out, a
fixed wait per batch) is served twice per round, once with ``KILN_HTTP_INFER_LANE=0`` (every request an ASGI task)
and once with the lane (infer requests answered from the connection's callbacks, kiln/frontends/http/infer_lane.py);
rounds alternate which goes first. wrk (C, little CPU of its own) posts the image with binary outputs from keep-alive
connections. Each row gives requests/s, p50/p99, and the CPU time per request of the worker processes together and
of the server process: what the lane saves is the CPU of whichever process serves HTTP (the workers; with
``--http-workers 1`` the server process), and where that process is the limit, requests.

    python benchmarks/infer_lane.py --http-workers 2 --concurrency 1,16,64 --rounds 3 \\
        --output benchmarks/results/infer_lane-<machine>-<date>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from _common import describe, header, http_worker_processes, int_list, table, write_outputs
from _loadgen import require_tools, run_wrk, tool_versions
from scheduler_ceiling import BACKEND
from served_ceiling import CONFIG, MODEL, serve_stand_in

from kiln.frontends.http.infer_lane import LANE_VARIABLE


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--http-workers", type=int, default=2)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="each wrk window (whole seconds)")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--base-ms", type=float, default=0.5, help="stand-in device time per batch")
    parser.add_argument("--per-row-us", type=float, default=10.0, help="stand-in device time per image")
    parser.add_argument("--output", type=Path, default=None, help="JSON results; a .txt beside it gets the table")
    args = parser.parse_args(argv)
    require_tools("wrk")
    where = f"{args.http_workers} HTTP workers" if args.http_workers > 1 else "HTTP in the server process"
    info = describe(f"the HTTP infer lane, off and on ({where}, device stand-in {args.base_ms:g} ms + "
                    f"{args.per_row_us:g} us per image)", tools=tool_versions())
    print(header(info), flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-infer-lane-") as tmp:
        repo = Path(tmp) / "repo"
        (repo / MODEL / "1").mkdir(parents=True)
        (repo / MODEL / "config.pbtxt").write_text(CONFIG.format(model=MODEL, backend=BACKEND, instances=1,
                                                                 batching=""))
        body, headers = image_request()
        for round_index in range(args.rounds):
            order = ("off", "on") if round_index % 2 == 0 else ("on", "off")
            for lane in order:
                rows += _measure(repo, lane, round_index + 1, body, headers, args, Path(tmp) / "serve.log")
    concurrencies = int_list(args.concurrency)
    text = header(info) + "\n" + table(
        ["round", "lane", "conc", "req/s", "p50 ms", "p99 ms", "worker us/req", "server us/req", "errors"],
        [[r["round"], r["lane"], r["concurrency"], r["rps"], r["p50_ms"], r["p99_ms"], r["worker_us"],
          r["server_us"], r["errors"]] for r in rows], numeric_from=2)
    text += "\n" + summary(rows, concurrencies) + "\n"
    print(text[len(header(info)):])
    write_outputs(args.output, {"info": info, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                  text)
    return 0


def image_request() -> tuple[bytes, dict[str, str]]:
    """One FP16 3x224x224 image with the binary-data extension, its output asked for as binary data."""
    image = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float16).tobytes()
    head = json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP16",
                                   "parameters": {"binary_data_size": len(image)}}],
                       "parameters": {"binary_data_output": True}}).encode()
    return head + image, {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))}


def _measure(repo: Path, lane: str, round_number: int, body: bytes, headers: dict[str, str],
             args: argparse.Namespace, log: Path) -> list[dict[str, Any]]:
    settings = [f"--stand-in-ms={args.base_ms}", f"--stand-in-row-us={args.per_row_us}"]
    environment = {LANE_VARIABLE: "1" if lane == "on" else "0"}
    rows = []
    with serve_stand_in(repo, settings, ["--http-workers", str(args.http_workers)], log,
                        environment) as (http_url, _grpc, _metrics, pid):
        server = psutil.Process(pid)
        workers = http_worker_processes(pid)
        for concurrency in int_list(args.concurrency):
            before = _cpu(server)
            result = run_wrk(f"http://{http_url}/v2/models/{MODEL}/infer", body, headers, concurrency,
                             args.seconds, args.warmup, server_pids=[w.pid for w in workers])
            server_cores = (_cpu(server) - before) / result.duration_s
            served = max(1.0, result.rps)
            rows.append({"round": round_number, "lane": lane, "concurrency": concurrency, "rps": result.rps,
                         "p50_ms": result.p50_ms, "p99_ms": result.p99_ms, "errors": result.errors,
                         "worker_us": (result.cpu_server or 0.0) / served * 1e6,
                         "server_us": server_cores / served * 1e6})
            print(rows[-1], flush=True)
    return rows


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def summary(rows: list[dict[str, Any]], concurrencies: list[int]) -> str:
    """Per concurrency, the median over rounds of lane-on / lane-off for requests/s, p50 and the CPU per request of
    the workers (where there are any) and of the server process."""
    lines = ["lane on / off, median over rounds:"]
    for concurrency in concurrencies:
        ratios: dict[str, list[float]] = {"req/s": [], "p50": [], "worker CPU per request": [],
                                          "server CPU per request": []}
        for round_number in sorted({r["round"] for r in rows}):
            pair = {r["lane"]: r for r in rows if r["round"] == round_number and r["concurrency"] == concurrency}
            if len(pair) < 2:
                continue
            on, off = pair["on"], pair["off"]
            ratios["req/s"].append(on["rps"] / off["rps"])
            ratios["p50"].append(on["p50_ms"] / off["p50_ms"])
            if off["worker_us"] > 0:
                ratios["worker CPU per request"].append(on["worker_us"] / off["worker_us"])
            ratios["server CPU per request"].append(on["server_us"] / off["server_us"])
        lines.append(f"  c={concurrency}: " + ", ".join(f"{name} {statistics.median(values):.2f}x"
                                                         for name, values in ratios.items() if values))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
