"""Whether one `kiln serve` process is what limits the served rows: N whole servers on the same machine (and GPU),
each loading the same models and driven by its own perf_analyzer at 1/N of the concurrency, against one server
driven at all of it.

Every server runs every request through its one server process's event loop (benchmarks/README.md, "What limits
the served rows"). If that loop is the limit, two servers answer close to twice what one does until the device or
the machine's cores are; if the device is, they answer what one does. The frontend worker processes are split
between the servers (``--http-workers`` and ``--grpc-workers`` each: --workers // N, where 1 means the frontend runs
in the server process itself), so N servers have no more frontend processes than one, and the GPU memory the
servers hold together is printed with each row (each server holds its own copy of the models).

    python benchmarks/served_replicas.py --repository /tmp/gpu16 --model resnet50 --servers 1,2 \\
        --concurrency 16,32 --input-data zero --perf-analyzer PATH \\
        --output benchmarks/results/served_replicas-<machine>-<date>.json

perf_analyzer comes with the ``perf-analyzer`` wheel on PyPI (it needs glibc 2.38 or newer).
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import describe, header, write_outputs
from before_after_perf_analyzer import SERVER_READY_S, measure

from kiln.demo import build_demo_repository
from kiln.serve_process import KilnProcess, kiln_serve


def gpu_memory_mib() -> int | None:
    """Memory in use on the machine's GPUs (nvidia-smi), or None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(int(line) for line in out.split())


def run_level(binary: str, servers: list[KilnProcess], model: str, protocol: str, concurrency: int,
              args: argparse.Namespace, folder: Path, extra: list[str]) -> dict[str, Any]:
    """Every server driven at once, each by its own perf_analyzer at ``concurrency / len(servers)``."""
    share = concurrency // len(servers)
    folders = [folder / f"server-{index}" for index in range(len(servers))]
    for path in folders:
        path.mkdir(exist_ok=True)
    with ThreadPoolExecutor(len(servers)) as pool:
        cells = list(pool.map(lambda pair: measure(binary, pair[0], model, protocol, share, args.window_ms,
                                                   args.stability, pair[1], extra), zip(servers, folders, strict=True)))
    rates = [cell["throughput"] for cell in cells]
    latencies = [cell["p50_us"] for cell in cells]
    stable = None not in rates and None not in latencies
    return {"servers": len(servers), "concurrency": concurrency, "per_server": cells,
            "throughput": sum(rate for rate in rates if rate is not None) if stable else None,
            "p50_us": max(p50 for p50 in latencies if p50 is not None) if stable else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--perf-analyzer", default="perf_analyzer", help="the perf_analyzer binary")
    parser.add_argument("--repository", type=Path, default=None,
                        help="a model repository holding --model (default: the demo repository, built here)")
    parser.add_argument("--model", default="simple")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http")
    parser.add_argument("--servers", default="1,2", help="how many servers, comma-separated: a row each")
    parser.add_argument("--concurrency", default="16", help="requests in flight over all servers, comma-separated")
    parser.add_argument("--workers", type=int, default=4,
                        help="HTTP (and gRPC) worker processes over all servers: each of N gets workers // N")
    parser.add_argument("--window-ms", type=int, default=2500, help="perf_analyzer's measurement interval")
    parser.add_argument("--stability", type=int, default=20,
                        help="perf_analyzer's --stability-percentage: windows agreeing within it count as stable")
    parser.add_argument("--input-data", default=None, help="perf_analyzer's --input-data (zero, random, a file)")
    parser.add_argument("--serve-args", default="", help="more `kiln serve` arguments for every server")
    parser.add_argument("--output", type=Path, default=None, help="JSON results (a .txt table goes beside it)")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.servers.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    if any(level % count for level in levels for count in counts):
        parser.error("every --concurrency must split evenly over every --servers count")
    extra = ["--input-data", args.input_data] if args.input_data else []
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-replicas-") as tmp:
        repo = args.repository
        if repo is None:
            repo = Path(tmp) / "repo"
            build_demo_repository(repo)
        for count in counts:
            workers = str(max(1, args.workers // count))
            serve_args = ["--model-control-mode", "explicit", "--load-model", args.model, "--http-workers", workers,
                          "--grpc-workers", workers, *args.serve_args.split()]
            with contextlib.ExitStack() as stack:
                servers = [stack.enter_context(kiln_serve([repo], *serve_args, log_path=Path(tmp) / f"{count}-{i}.log",
                                                          ready_timeout_s=SERVER_READY_S))
                           for i in range(count)]
                memory = gpu_memory_mib()
                for concurrency in levels:
                    level = Path(tmp) / f"{count}-{concurrency}"
                    level.mkdir()
                    row = run_level(args.perf_analyzer, servers, args.model, args.protocol, concurrency, args,
                                    level, extra)
                    row["gpu_memory_mib"] = memory
                    rows.append(row)
                    print(f"{count} server(s), c={concurrency}: {row['throughput']}/s", file=sys.stderr)
    info = describe("Served by one kiln serve against several on one machine", model=args.model,
                    protocol=args.protocol, frontend_workers=f"{args.workers} over all the servers")
    text = header(info) + "\n" + "\n".join(table(rows)) + "\n"
    print(text, end="")
    write_outputs(args.output, {**info, "rows": rows}, text)
    return 0


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| servers | c | inferences/s | vs one server | p50 us (slowest server) | rows/exec per server "
             "| GPU memory MiB |",
             "|---|---|---|---|---|---|---|"]
    one = {row["concurrency"]: row["throughput"] for row in rows if row["servers"] == 1}
    for row in rows:
        rate, base = row["throughput"], one.get(row["concurrency"])
        ratio = f"{rate / base:.2f}x" if rate is not None and base else "-"
        per_server = " / ".join("-" if cell["rows_per_execution"] is None else f"{cell['rows_per_execution']:.1f}"
                                for cell in row["per_server"])
        shown = "unstable" if rate is None else f"{rate:,.0f}"
        p50 = "-" if row["p50_us"] is None else f"{row['p50_us']:,.0f}"
        memory = "-" if row["gpu_memory_mib"] is None else str(row["gpu_memory_mib"])
        lines.append(f"| {row['servers']} | {row['concurrency']} | {shown} | {ratio} | {p50} | {per_server} "
                     f"| {memory} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
