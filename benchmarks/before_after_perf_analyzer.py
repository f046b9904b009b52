"""One change, measured by NVIDIA's perf_analyzer: `kiln serve` from two src/ trees in turn (before, after), or one
tree under two environments (a switch such as ``KILN_HTTP_INFER_LANE=0``), each driven by the same C++ client over
HTTP and gRPC at each concurrency.

Rounds alternate the two servers, and which of them goes first, so that drift of a shared machine falls on both;
every cell is perf_analyzer's own stable measurement (three windows within --stability percent). The table gives
throughput and p50 latency per tree and the ratio after / before; the last lines give the median ratio per
protocol.

    git worktree add /tmp/before <commit>       # or: git archive <commit> src | tar -x -C /tmp/before
    python benchmarks/before_after_perf_analyzer.py --before /tmp/before/src --perf-analyzer PATH \\
        --output benchmarks/results/<what>.json

A switch in the environment is measured with ``--before-env`` / ``--after-env`` (each ``NAME=VALUE``, repeatable),
both trees this checkout's unless ``--before`` says otherwise; the HTTP workers' infer lane off and on:

    python benchmarks/before_after_perf_analyzer.py --before-env KILN_HTTP_INFER_LANE=0 --repository /tmp/gpu16 \\
        --models resnet50 --protocols http --concurrency 1,8,16,64 --input-data zero --window-ms 500 \\
        --output benchmarks/results/<what>.json

A GPU model is measured the same way from a repository of built models, for instance the ResNet-50 of
benchmarks/README.md ("The GPU figures now"), its images as zeros, and in system shared memory:

    python benchmarks/before_after_perf_analyzer.py --before /tmp/before/src --repository /tmp/gpu16 \\
        --models resnet50 --protocols http --concurrency 16,64 --input-data zero --window-ms 2500 \\
        --output benchmarks/results/<what>.json          # add --shared-memory system for the client's regions

Each cell also gives the rows per execution the server formed (its metrics over the cell's run), the CPU time per
request of the server process and of its worker processes together (over the cell's perf_analyzer run) and, over
HTTP, how many of perf_analyzer's connections each HTTP worker held (busiest first). perf_analyzer's memory grows with
every request it sends (it keeps each request's inputs; upstream issue 84): each run is watched as `kiln bench` watches
it, and a run stopped for its memory is measured again over windows half as long, down to 250 ms (a 301 KB image at
c=64 can fill 60 GB within a few 2,000 ms windows); the window each cell was measured over is in the JSON.

perf_analyzer comes with the ``perf-analyzer`` wheel on PyPI (it needs glibc 2.38 or newer).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

SRC = Path(__file__).resolve().parents[1] / "src"
SERVER_READY_S = 300.0  # a compiled GPU build loads in 20-40 s, more with a cold compile cache
RUN_TIMEOUT_S = 600.0
WORKERS_LISTEN_S = 60.0
NO_GAUGE_SETTLE_S = 5.0
SPREAD_EVERY_S = 0.25  # how often the HTTP workers' connection counts are read during a cell
sys.path.insert(0, str(SRC))

from _common import http_worker_processes  # noqa: E402  # beside this script

from kiln.bench.machine import machine_info  # noqa: E402
from kiln.bench.perf_analyzer import MemoryStopped, shorter_window, wait_watched  # noqa: E402
from kiln.demo import build_demo_repository  # noqa: E402
from kiln.serve_process import KilnProcess, kiln_serve  # noqa: E402


@contextmanager
def server_from(src: Path, repo: Path, models: list[str], log: Path, serve_args: list[str] | None = None,
                environment: dict[str, str] | None = None) -> Iterator[KilnProcess]:
    """`kiln serve` (with ``serve_args``) with ``src`` first on the child's path and ``environment`` set (what it
    inherits from this process)."""
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", *(environment or {}))}
    os.environ.update(environment or {})
    python_path = saved["PYTHONPATH"]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(src.resolve()), *([python_path] if python_path else [])])
    try:
        load = [arg for model in models for arg in ("--load-model", model)]
        with kiln_serve([repo], "--model-control-mode", "explicit", *load, *(serve_args or []),
                        log_path=log, ready_timeout_s=SERVER_READY_S) as server:
            wait_workers_listening(server)
            yield server
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def parse_environment(items: list[str], flag: str) -> dict[str, str]:
    """``NAME=VALUE`` items as a mapping; a malformed one is refused naming ``flag``."""
    environment = {}
    for item in items:
        name, equals, value = item.partition("=")
        if not equals or not name:
            raise SystemExit(f"{flag} takes NAME=VALUE, got {item!r}")
        environment[name] = value
    return environment


class ProcessCpu:
    """CPU seconds of the server process and, apart, of its worker processes together, over a ``with`` block (a
    worker replaced meanwhile counts for neither of its parts: the cell's figure is then a little low)."""

    def __init__(self, server: KilnProcess) -> None:
        self._server = psutil.Process(server.process.pid)
        self.server_s = self.workers_s = 0.0

    def __enter__(self) -> ProcessCpu:
        self._before = self._read()
        return self

    def __exit__(self, *_: object) -> None:
        after = self._read()
        self.server_s = after[self._server.pid] - self._before[self._server.pid]
        self.workers_s = sum(after[pid] - self._before[pid] for pid in after
                             if pid != self._server.pid and pid in self._before)

    def _read(self) -> dict[int, float]:
        seconds = {}
        for process in (self._server, *self._server.children()):
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            seconds[process.pid] = float(times.user + times.system)
        return seconds


def metrics_text(server: KilnProcess) -> str:
    with urllib.request.urlopen(f"http://{server.metrics_url}/metrics", timeout=10) as response:
        return str(response.read().decode())


def wait_workers_listening(server: KilnProcess) -> None:
    """Until every HTTP worker of ``server`` listens. A tree whose readiness does not wait for its workers answers
    ready from the first one listening, and perf_analyzer, opening its connections at once, would leave all of them
    with that worker for the whole cell. A tree without the workers' connection gauge gets a fixed settling time."""
    workers = http_worker_processes(server.process.pid)
    deadline = time.monotonic() + WORKERS_LISTEN_S
    while workers:
        text = metrics_text(server)
        if "kiln_http_worker_connections" not in text:
            time.sleep(NO_GAUGE_SETTLE_S)
            return
        if text.count("kiln_http_worker_connections{") >= len(workers):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the HTTP workers of the server at {server.http_url} did not all listen within "
                               f"{WORKERS_LISTEN_S:.0f} s")
        time.sleep(0.1)


class ConnectionSpread:
    """The HTTP connections each worker of ``server`` holds while a cell runs, read from its
    ``kiln_http_worker_connections`` gauge every ``SPREAD_EVERY_S`` on a thread of its own; ``counts`` keeps the
    reading with the most connections, busiest worker first (None: no gauge, one HTTP process). All of a client's
    connections on one worker caps a cell at what that worker's loop carries
    (results/served_core_profile-h100-2026-12-07.md)."""

    def __init__(self, server: KilnProcess) -> None:
        self._server = server
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="connection-spread", daemon=True)
        self.counts: list[int] | None = None

    def __enter__(self) -> ConnectionSpread:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while True:
            counts = self.read()
            if counts is not None and (self.counts is None or sum(counts) >= sum(self.counts)):
                self.counts = counts
            if self._stop.wait(SPREAD_EVERY_S):
                return

    def read(self) -> list[int] | None:
        try:
            text = metrics_text(self._server)
        except OSError:  # the server is going away: the readings so far stand
            return None
        values = re.findall(r'^kiln_http_worker_connections\{process="[^"]*"\} (\S+)$', text, re.MULTILINE)
        return sorted((int(float(value)) for value in values), reverse=True) or None


def measure(binary: str, server: KilnProcess, model: str, protocol: str, concurrency: int, window_ms: int,
            stability: int, folder: Path, extra: list[str], memory_limit_bytes: int | None = None) -> dict[str, Any]:
    """Throughput (inferences/s), p50 latency (us), the server's rows per execution, the CPU per request of the
    server process and of its workers (us), (HTTP) the connections each HTTP worker held (ConnectionSpread) and
    the window it was measured over, of one perf_analyzer run. A cell that does not stabilise is tried once more
    with windows twice as long; one stopped for perf_analyzer's memory (it keeps every request's inputs,
    docs/bench.md) is tried again over windows half as long, down to ``SHORTEST_WINDOW_MS``, as `kiln bench` does.
    A cell that still has no figure is recorded as None (unstable) rather than ending the run.
    ``memory_limit_bytes``: the guard's limit (None: kiln bench's default)."""
    out = folder / f"{model}-{protocol}-{concurrency}.csv"
    url = server.http_url if protocol == "http" else server.grpc_url
    unstable: dict[str, Any] = {"throughput": None, "p50_us": None, "rows_per_execution": None,
                                "server_cpu_us": None, "workers_cpu_us": None, "http_connections": None,
                                "window_ms": None}
    window: int | None = window_ms
    lengthened = False
    while window is not None:
        command = [binary, "-m", model, "-u", url, "-i", protocol, "--concurrency-range",
                   f"{concurrency}:{concurrency}", "--measurement-interval", str(window), "--stability-percentage",
                   str(stability), "--max-trials", "8", "-f", str(out), *extra]
        counted = _counts(server, model)
        with tempfile.TemporaryFile("w+") as log, ConnectionSpread(server) as spread, ProcessCpu(server) as cpu:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
            try:
                code = wait_watched(process, RUN_TIMEOUT_S, memory_limit_bytes, model,
                                    functools.partial(" ".join, command))
            except MemoryStopped as stopped:
                tried, window = window, shorter_window(window)
                print(f"  {stopped.held} over {tried} ms windows: "
                      + (f"again over {window} ms" if window else "recorded as unstable"), file=sys.stderr)
                continue
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            log.seek(0)
            text = log.read()
        if code == 0:
            with out.open() as f:
                row = next(csv.DictReader(f))
            requests, executions = (after - before for after, before in zip(_counts(server, model), counted,
                                                                             strict=True))
            per_request = 1e6 / requests if requests else 0.0
            return {"throughput": float(row["Inferences/Second"]), "p50_us": float(row["p50 latency"]),
                    "rows_per_execution": requests / executions if executions else None,
                    "server_cpu_us": cpu.server_s * per_request, "workers_cpu_us": cpu.workers_s * per_request,
                    "http_connections": spread.counts if protocol == "http" else None, "window_ms": window}
        if "stable measurement" not in text:
            raise RuntimeError(f"perf_analyzer failed ({code}): {' '.join(command)}\n{text[-4000:]}")
        if lengthened:
            break
        window, lengthened = 2 * window, True
    return unstable


def _counts(server: KilnProcess, model: str) -> tuple[float, float]:
    """The model's inferences and executions so far, from the server's metrics."""
    text = metrics_text(server)
    found = []
    for family in ("nv_inference_count", "nv_inference_exec_count"):
        values = re.findall(rf'^{family}{{model="{re.escape(model)}",version="[^"]*"}} (\S+)$', text, re.MULTILINE)
        found.append(sum(float(value) for value in values))
    return found[0], found[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, default=SRC,
                        help="the src/ folder of the code before the change (default: this checkout)")
    parser.add_argument("--after", type=Path, default=SRC, help="the src/ folder after it (default: this checkout)")
    parser.add_argument("--before-env", action="append", default=[], metavar="NAME=VALUE",
                        help="set in the environment of the server before the change (repeatable)")
    parser.add_argument("--after-env", action="append", default=[], metavar="NAME=VALUE",
                        help="set in the environment of the server after it (repeatable)")
    parser.add_argument("--perf-analyzer", default="perf_analyzer", help="the perf_analyzer binary")
    parser.add_argument("--models", default="simple,mlp")
    parser.add_argument("--protocols", default="http,grpc")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window-ms", type=int, default=1500, help="perf_analyzer's measurement interval")
    parser.add_argument("--stability", type=int, default=20,
                        help="perf_analyzer's --stability-percentage: windows agreeing within it count as stable")
    parser.add_argument("--serve-args", default="", help="more `kiln serve` arguments for both trees, e.g. "
                                                         "'--grpc-workers 4'")
    parser.add_argument("--repository", type=Path, default=None,
                        help="a model repository holding --models (default: the demo repository, built here)")
    parser.add_argument("--input-data", default=None, help="perf_analyzer's --input-data (zero, random, a file)")
    parser.add_argument("--memory-limit-mb", type=int, default=None,
                        help="stop a perf_analyzer run holding more MiB (default: half of the free memory)")
    parser.add_argument("--shared-memory", choices=("none", "system"), default="none",
                        help="the inputs and outputs in system shared memory (the servers get --allow-client-shm)")
    parser.add_argument("--output", type=Path, default=None, help="JSON results (a .txt table goes beside it)")
    args = parser.parse_args(argv)
    environments = {"before": parse_environment(args.before_env, "--before-env"),
                    "after": parse_environment(args.after_env, "--after-env")}
    if args.before.resolve() == args.after.resolve() and environments["before"] == environments["after"]:
        parser.error("before and after are the same: give --before another src/ tree, or --before-env/--after-env")
    models, protocols = args.models.split(","), args.protocols.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    rows: list[dict[str, Any]] = []
    extra = ["--input-data", args.input_data] if args.input_data else []
    serve_args = args.serve_args.split()
    if args.shared_memory != "none":
        extra += ["--shared-memory", args.shared_memory]
        serve_args.append("--allow-client-shm")
    with tempfile.TemporaryDirectory(prefix="kiln-pa-before-after-") as tmp:
        repo = args.repository
        if repo is None:
            repo = Path(tmp) / "repo"
            build_demo_repository(repo)
        for round_ in range(1, args.rounds + 1):
            trees = [("before", args.before), ("after", args.after)]
            # Odd rounds run before first, even rounds after first: a drift within a round falls on both alike.
            for label, src in trees if round_ % 2 else trees[::-1]:
                with server_from(src, repo, models, Path(tmp) / f"{label}-{round_}.log", serve_args,
                                 environments[label]) as server:
                    for model in models:
                        for protocol in protocols:
                            for concurrency in levels:
                                cell = measure(args.perf_analyzer, server, model, protocol, concurrency,
                                               args.window_ms, args.stability, Path(tmp), extra,
                                               memory_limit_bytes=args.memory_limit_mb and args.memory_limit_mb << 20)
                                rows.append({"round": round_, "tree": label, "model": model, "protocol": protocol,
                                             "concurrency": concurrency, **cell})
                                print(f"round {round_} {label} {model} {protocol} c={concurrency}: {cell}",
                                      file=sys.stderr)
                                write(args, argv, rows)  # after every cell: a run cut short keeps what it measured
    print("\n".join(table(rows, args, argv)))
    return 0


def write(args: argparse.Namespace, argv: list[str] | None, rows: list[dict[str, Any]]) -> None:
    """The JSON results and the table beside them, as far as the run has got (nothing without --output)."""
    if args.output is None:
        return
    args.output.write_text(json.dumps({"machine": machine_info(), "command": command_line(argv), "rows": rows},
                                      indent=1) + "\n")
    args.output.with_suffix(".txt").write_text("\n".join(table(rows, args, argv)) + "\n")


def table(rows: list[dict[str, Any]], args: argparse.Namespace, argv: list[str] | None) -> list[str]:
    """One line per (model, protocol, concurrency, round): before and after side by side, and their ratio."""
    info = machine_info()
    lines = [f"perf_analyzer before/after, {info['date']}, {info['cpu_model']}, {info['cpu_count']} CPUs, "
             f"GPUs: {', '.join(info['gpus']) or 'none'}",
             f"before: {_side(args.before, getattr(args, 'before_env', []))}; "
             f"after: {_side(args.after, getattr(args, 'after_env', []))}; command: {command_line(argv)}", "",
             "| model | protocol | c | round | before /s | after /s | after/before | p50 before us | p50 after us "
             "| rows/exec before | rows/exec after | CPU us/request before: server + workers | after "
             "| connections by worker before | after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios: dict[str, list[float]] = {}
    key = ("model", "protocol", "concurrency", "round")
    cells = {(tuple(r[k] for k in key), r["tree"]): r for r in rows}
    for cell_key in sorted({tuple(r[k] for k in key) for r in rows}):
        before, after = cells.get((cell_key, "before")), cells.get((cell_key, "after"))
        if before is None or after is None:  # the run has not measured the other tree yet
            lines.append(f"| {cell_key[0]} | {cell_key[1]} | {cell_key[2]} | {cell_key[3]} | "
                         f"{_rate(before['throughput']) if before else 'not yet'} | "
                         f"{_rate(after['throughput']) if after else 'not yet'} | | | |")
            continue
        if before["throughput"] is None or after["throughput"] is None:
            lines.append(f"| {cell_key[0]} | {cell_key[1]} | {cell_key[2]} | {cell_key[3]} | "
                         f"{_rate(before['throughput'])} | {_rate(after['throughput'])} | unstable | | |")
            continue
        ratio = after["throughput"] / before["throughput"]
        ratios.setdefault(str(cell_key[1]), []).append(ratio)
        lines.append(f"| {cell_key[0]} | {cell_key[1]} | {cell_key[2]} | {cell_key[3]} | {before['throughput']:,.0f} "
                     f"| {after['throughput']:,.0f} | {ratio:.2f} | {before['p50_us']:,.0f} | {after['p50_us']:,.0f} "
                     f"| {_rows(before)} | {_rows(after)} | {_cpu(before)} | {_cpu(after)} "
                     f"| {_spread(before)} | {_spread(after)} |")
    lines.append("")
    lines += [f"median after/before, {protocol}: {statistics.median(values):.2f} over {len(values)} cells"
              for protocol, values in sorted(ratios.items())]
    return lines


def _rows(cell: dict[str, Any]) -> str:
    value = cell.get("rows_per_execution")
    return "-" if value is None else f"{value:.1f}"


def _cpu(cell: dict[str, Any]) -> str:
    server, workers = cell.get("server_cpu_us"), cell.get("workers_cpu_us")
    return "-" if server is None or workers is None else f"{server:,.0f} + {workers:,.0f}"


def _side(src: Path, environment: list[str]) -> str:
    return " ".join([str(src), *environment])


def _spread(cell: dict[str, Any]) -> str:
    counts = cell.get("http_connections")
    return "-" if not counts else "/".join(map(str, counts))


def _rate(value: float | None) -> str:
    return "unstable" if value is None else f"{value:,.0f}"


def command_line(argv: list[str] | None) -> str:
    return shlex.join(["python", "benchmarks/before_after_perf_analyzer.py", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
