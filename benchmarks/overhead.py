"""What serving costs: kiln served (HTTP JSON, HTTP binary, gRPC) vs kiln called directly, one row per request.

For each demo model (``simple``, ``mlp``) and each concurrency (default 1, 8, 16):

* direct:      ``kiln bench --target direct`` in this process (N threads calling ``engine.infer``), windows of a
               third of ``--duration`` until three agree within 10% (at most ten);
* http-json:   ``POST /v2/models/<m>/infer`` with a V2 JSON body, driven by ``wrk`` (N connections);
* http-binary: the same with the binary tensor data extension (JSON header + raw bytes; binary outputs);
* grpc:        unary ``ModelInfer`` with ``raw_input_contents``, driven by ``h2load`` (N connections, 1 call each;
               ``--grpc-connections 1``: N calls on one connection, as perf_analyzer and tritonclient send them).

Every served mode sends bytes that were first posted once and checked against a numpy reference; during a window,
failed requests count as errors, never as throughput. ``kiln serve`` runs on free ports and stops at the end.
The served/direct columns divide served throughput (and p50 latency) by the direct figure at the same concurrency.

    python benchmarks/overhead.py [--duration 5] [--warmup 1] [--concurrency 1,8,16] [--models simple,mlp]
                                  [--modes direct,http-json,http-binary,grpc] [--console [--rounds 2]]
                                  [--output results.json]

``--console`` measures what the browser console costs the inference path, side by side in one run: two servers
on the same repository, one with ``--allow-console false`` ("console off"), one with the console open ("console
open": a poller fetches the status document once a second, as the page does, during that server's windows; the
first fetch attaches the console's latency window, which stays, as it does once a page has looked). Windows of the
two alternate (off, open, off, open, ... ``--rounds`` times each); the table gives each one's median and open/off.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from _common import (
    Case,
    describe,
    header,
    int_list,
    model_case,
    str_list,
    table,
    verify_grpc,
    verify_http,
    write_outputs,
)
from _loadgen import GRPC_CONNECTIONS_HELP, LoadResult, require_tools, run_h2load, run_wrk, tool_versions, wait_quiet

from kiln.bench import BenchOptions, run
from kiln.demo import build_demo_repository
from kiln.serve_process import KilnProcess, kiln_serve

MODES = ("direct", "http-json", "http-binary", "grpc")
TOOLS = {"http-json": "wrk", "http-binary": "wrk", "grpc": "h2load"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=5.0, help="measurement window, seconds (default 5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="served: warm-up before each window (default 1)")
    parser.add_argument("--concurrency", default="1,8,16", help="comma-separated concurrencies (default 1,8,16)")
    parser.add_argument("--models", default="simple,mlp", help="comma-separated demo models (default simple,mlp)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"subset of {','.join(MODES)}")
    parser.add_argument("--grpc-connections", type=int, default=None,
                        help=GRPC_CONNECTIONS_HELP)
    parser.add_argument("--wrk-threads", type=int, default=1, help="wrk threads (default 1: leave a core to kiln)")
    parser.add_argument("--max-wait-quiet", type=float, default=120.0,
                        help="before each window, wait up to this long for other processes to go idle (0: don't)")
    parser.add_argument("--output", type=Path, default=None, help="JSON results (a .txt beside it gets the text)")
    parser.add_argument("--console", action="store_true",
                        help="served modes: console off vs console open with live updates, side by side")
    parser.add_argument("--rounds", type=int, default=2, help="--console: windows of each server (default 2)")
    args = parser.parse_args(argv)
    concurrencies, models, modes = int_list(args.concurrency), str_list(args.models), str_list(args.modes)
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}")
    require_tools(*sorted({TOOLS[m] for m in modes if m in TOOLS}))

    info = describe("kiln serving overhead: served vs direct, one row per request", tools=tool_versions(),
                    settings=f"window {args.duration:g} s; served: {args.warmup:g} s warm-up, wrk "
                             f"-t{args.wrk_threads}, h2load -t1 "
                             + ("-m1 (a connection per call)" if args.grpc_connections is None else
                                f"over {args.grpc_connections} connection(s)"))
    print(header(info), flush=True)
    results: list[dict[str, Any]] = []
    costs: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-overhead-") as tmp_name:
        tmp = Path(tmp_name)
        repo = tmp / "repo"
        build_demo_repository(repo)
        cases = {m: model_case(repo, m) for m in models}
        if "direct" in modes:
            for model in models:
                results += _direct(repo, model, concurrencies, args)
        served = [m for m in modes if m != "direct"]
        if served and args.console:
            costs = _console_costs(repo)
            results += _console_runs(repo, tmp, cases, served, concurrencies, args)
        elif served:
            with kiln_serve([repo], log_path=tmp / "kiln-serve.log", ready_timeout_s=180) as server:
                for model in models:
                    results += _served(server, cases[model], served, concurrencies, args)
                if server.process.poll() is not None:
                    raise RuntimeError("kiln serve died during the run")
    text = header(info) + "\n" + (_console_table(results, costs) if args.console else
                                   _table(results, models, modes, concurrencies))
    print(text[len(header(info)):])
    write_outputs(args.output, {"machine": info, "args": vars(args), "results": results, "console_costs": costs},
                  text)
    return 0


def _direct(repo: Path, model: str, concurrencies: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    window_ms = max(50, int(args.duration * 1000 / 3))
    for c in concurrencies:
        wait_quiet(None, args.max_wait_quiet)
        bench = run(BenchOptions(model=model, target="direct", model_repository=repo, concurrency=(c,),
                                 measurement_interval_ms=window_ms, max_trials=10))
        level = bench.results[0]
        result = LoadResult("kiln bench", c, level.duration_s, level.requests, level.errors,
                            level.throughput_infer_per_s, level.latency_ms.p50, level.latency_ms.p99,
                            level.latency_ms.avg, "" if level.stable else "not stable")
        print(f"direct       {model:6s} c={c:<3d} {result.line()}", flush=True)
        out.append({"model": model, "mode": "direct", "result": result})
    return out


def _served(server: KilnProcess, case: Case, modes: list[str], concurrencies: list[int],
            args: argparse.Namespace) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    pids = [server.process.pid]
    url = f"http://{server.http_url}/v2/models/{case.model}/infer"
    for mode in modes:
        if mode == "grpc":
            message, response = verify_grpc(server.grpc_url, case)
        else:
            body, headers = verify_http(server.http_url, case, binary=mode == "http-binary")
        for c in concurrencies:
            wait_quiet(pids, args.max_wait_quiet)
            if mode == "grpc":
                result = run_h2load(f"http://{server.grpc_url}", message, c, args.duration, args.warmup,
                                    expected_response_bytes=len(response), server_pids=pids,
                                    connections=args.grpc_connections)
            else:
                result = run_wrk(url, body, headers, c, args.duration, args.warmup, threads=args.wrk_threads,
                                 server_pids=pids)
            print(f"{mode:12s} {case.model:6s} c={c:<3d} {result.line()}", flush=True)
            out.append({"model": case.model, "mode": mode, "result": result})
    return out


def _console_runs(repo: Path, tmp: Path, cases: dict[str, Case], modes: list[str], concurrencies: list[int],
                  args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each served window on the console-off server, then the same on the console-open one, ``--rounds`` times."""
    out: list[dict[str, Any]] = []
    with kiln_serve([repo], "--allow-console", "false", log_path=tmp / "off.log", ready_timeout_s=180) as off, \
            kiln_serve([repo], log_path=tmp / "open.log", ready_timeout_s=180) as opened:
        for case in cases.values():
            for mode in modes:
                for c in concurrencies:
                    for round_ in range(args.rounds):
                        for variant, server in (("console off", off), ("console open", opened)):
                            polls = [0]
                            with _polling(server, polls) if variant == "console open" else contextlib.nullcontext():
                                [row] = _served(server, case, [mode], [c], args)
                            out.append({**row, "variant": variant, "round": round_, "status_polls": polls[0]})
        for server in (off, opened):
            if server.process.poll() is not None:
                raise RuntimeError("kiln serve died during the run")
    return out


def _console_costs(repo: Path, calls: int = 100_000, documents: int = 50) -> dict[str, float]:
    """What the open console adds, measured in process where a busy machine blurs the served windows: the
    latency window's cost per successful request, and the CPU time of building one status document."""
    from kiln.console.status import LatencyWindow, StatusSource
    from kiln.server.server import Server, ServerOptions
    from kiln.server.stats import RequestTimes

    window, times = LatencyWindow(), RequestTimes("simple", "1", 300_000, 10_000, 1_000, 50_000, 1_000)
    started = time.process_time_ns()
    for _ in range(calls):
        window.observe(times)
    observe_ns = (time.process_time_ns() - started) / calls
    server = Server(ServerOptions(repositories=[repo]))
    server.start()
    try:
        source = StatusSource(server)
        source.document()
        started = time.process_time_ns()
        for _ in range(documents):
            source.document()
        document_ms = (time.process_time_ns() - started) / documents / 1e6
    finally:
        server.close()
    return {"observe_ns_per_request": observe_ns, "status_document_cpu_ms": document_ms}


@contextlib.contextmanager
def _polling(server: KilnProcess, polls: list[int], interval_s: float = 1.0) -> Iterator[None]:
    """What an open console page asks of the server: its status document once a second (``polls[0]`` counts)."""
    stop = threading.Event()
    url = f"http://{server.http_url}/v2/kiln/console/status"

    def poll() -> None:
        while not stop.is_set():
            with urllib.request.urlopen(url, timeout=10) as answer:
                answer.read()
            polls[0] += 1
            stop.wait(interval_s)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _console_table(results: list[dict[str, Any]], costs: dict[str, float]) -> str:
    cells: dict[tuple[str, str, int], dict[str, list[LoadResult]]] = {}
    for r in results:
        cells.setdefault((r["model"], r["mode"], r["result"].concurrency), {}).setdefault(
            r["variant"], []).append(r["result"])
    rows, ratios = [], []
    for (model, mode, c), variants in cells.items():
        off, opened = variants["console off"], variants["console open"]
        off_rps, open_rps = statistics.median(x.rps for x in off), statistics.median(x.rps for x in opened)
        ratio = open_rps / off_rps if off_rps else None
        ratios += [ratio] if ratio is not None else []
        rows.append([model, mode, c, off_rps, open_rps, f"{ratio:.3f}" if ratio else None,
                     statistics.median(x.p50_ms for x in off), statistics.median(x.p50_ms for x in opened),
                     statistics.median(x.p99_ms for x in off), statistics.median(x.p99_ms for x in opened),
                     sum(x.errors for x in off + opened)])
    summary = (f"\nopen/off req/s: median {statistics.median(ratios):.3f} over {len(ratios)} cells (range "
               f"{min(ratios):.3f}-{max(ratios):.3f})\n") if ratios else ""
    return ("## Console off vs console open (medians over the rounds; req/s counts only correct answers; ms)\n\n"
            + table(["model", "mode", "conc", "req/s off", "req/s open", "open/off", "p50 off", "p50 open",
                     "p99 off", "p99 open", "errors"], rows, numeric_from=2) + summary
            + f"\nin process: the latency window costs {costs['observe_ns_per_request']:.0f} ns of CPU per successful "
              f"request; one status document (demo repository) {costs['status_document_cpu_ms']:.2f} ms of CPU, "
              f"once a second per open page\n")


def _table(results: list[dict[str, Any]], models: list[str], modes: list[str], concurrencies: list[int]) -> str:
    by_key: dict[tuple[str, str, int], LoadResult] = {
        (r["model"], r["mode"], r["result"].concurrency): r["result"] for r in results}
    rows = []
    for model in models:
        for mode in modes:
            for c in concurrencies:
                r = by_key.get((model, mode, c))
                if r is None:
                    continue
                d = by_key.get((model, "direct", c))
                served = d is not None and mode != "direct"
                rps_ratio = f"{r.rps / d.rps:.3f}" if served and d is not None and d.rps else None
                p50_ratio = f"{r.p50_ms / d.p50_ms:.1f}x" if served and d is not None and d.p50_ms else None
                rows.append([model, mode, c, r.rps, r.p50_ms, r.p99_ms, r.ok, r.errors, rps_ratio, p50_ratio,
                             _cores(r.cpu_server), _cores(r.cpu_loadgen), _cores(r.cpu_other)])
    return ("## Results (req/s counts only correct answers; latencies in ms; ratios served/direct)\n\n"
            + table(["model", "mode", "conc", "req/s", "p50 ms", "p99 ms", "ok", "errors", "req/s served/direct",
                     "p50 served/direct", "cpu server", "cpu loadgen", "cpu other"], rows, numeric_from=2)
            + "\ncpu columns: average cores busy during a served window (server processes; load generator; all "
              "other processes on the machine)\n")


def _cores(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
