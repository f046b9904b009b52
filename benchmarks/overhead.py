"""What serving costs: kiln served (HTTP JSON, HTTP binary, gRPC) vs kiln called directly, one row per request.

For each model (``simple``, ``mlp`` from ``kiln demo-repo``) and each concurrency (1, 8, 16):

* direct:      ``kiln.load(<repo>/<model>)`` in this process, N threads each calling ``engine.infer`` in a loop;
* http-json:   ``POST /v2/models/<m>/infer`` with a V2 JSON body, driven by ``wrk`` (N connections);
* http-binary: the same with the binary tensor data extension (JSON header + raw bytes,
               ``Inference-Header-Content-Length``; outputs requested as binary), driven by ``wrk``;
* grpc:        unary ``ModelInfer`` with ``raw_input_contents``, driven by ``h2load`` (N connections, 1 stream each).

Each cell is a fixed window (``--duration``) after a warm-up (``--warmup``); only correct answers count (every
mode is checked against a numpy reference before it is measured; non-200 / failed gRPC calls during the window
are counted as errors, not throughput). The served/direct columns divide served throughput (and p50 latency) by
the direct figure at the same concurrency. The server is ``kiln serve`` started here on free ports and stopped at
the end; wrk and h2load come from Debian (installed with apt-get when missing).

    .venv/bin/python benchmarks/overhead.py [--duration 5] [--warmup 1] [--concurrency 1,8,16]
                                            [--models simple,mlp] [--output results.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    GRPC_INFER_PATH,
    CpuMeter,
    LoadResult,
    ServerProcess,
    Tensor,
    binary_body,
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
    model_case,
    parse_binary_response,
    parse_grpc_response,
    parse_json_response,
    project_env,
    run_h2load,
    run_wrk,
    running,
    wait_quiet,
    write_json,
)

MODES = ("direct", "http-json", "http-binary", "grpc")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=5.0, help="measurement window, seconds (default 5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="warm-up before each window, seconds (default 1)")
    parser.add_argument("--concurrency", default="1,8,16", help="comma-separated concurrencies (default 1,8,16)")
    parser.add_argument("--models", default="simple,mlp", help="comma-separated demo models (default simple,mlp)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"subset of {','.join(MODES)}")
    parser.add_argument("--wrk-threads", type=int, default=1, help="wrk threads (default 1: leave a core to kiln)")
    parser.add_argument("--max-wait-quiet", type=float, default=120.0,
                        help="before each window, wait up to this long for other processes to go idle (default 120)")
    parser.add_argument("--output", type=Path, default=None, help="write all results as JSON here")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}")

    ensure_tools()
    info = machine_info()
    info["command"] = command_line()
    for line in header_lines("kiln serving overhead: served vs direct, one row per request", info):
        print(line, flush=True)
    print(f"window {args.duration:g} s after {args.warmup:g} s warm-up; concurrency {concurrencies}; "
          f"wrk -t{args.wrk_threads}, h2load -t1 -m1\n", flush=True)
    if any(m != "direct" for m in modes):
        ok, why = kiln_serve_available()
        if not ok:
            print(f"kiln serve is not available: {why}", file=sys.stderr)
            return 2

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-overhead-") as tmp_name:
        tmp = Path(tmp_name)
        repo = tmp / "repo"
        build_demo_repo(repo)
        cases = {m: model_case(repo, m) for m in models}
        if "direct" in modes:
            for model in models:
                results += _direct(repo, model, cases[model], concurrencies, args)
        served = [m for m in modes if m != "direct"]
        if served:
            results += _served(tmp, repo, models, cases, served, concurrencies, args)

    lines = _table(results, models, modes, concurrencies)
    for line in lines:
        print(line)
    if args.output:
        write_json(args.output, {"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                                 "results": results})
    return 0


# --------------------------------------------------------------------------------------------------------------


def _direct(repo: Path, model: str, case: tuple[list[Tensor], dict[str, np.ndarray]], concurrencies: list[int],
            args: argparse.Namespace) -> list[dict[str, Any]]:
    import kiln

    inputs, expected = case
    feed = {t.name: t.array for t in inputs}
    out: list[dict[str, Any]] = []
    with kiln.load(repo / model) as engine:
        check_outputs(dict(engine.infer(feed)), expected, f"direct {model}")
        for c in concurrencies:
            wait_quiet(None, args.max_wait_quiet)
            with CpuMeter(None) as meter:
                result = _direct_window(engine, feed, expected, c, args.warmup, args.duration)
            meter.apply(result)
            print(f"direct       {model:6s} c={c:<3d} {_fmt(result)}", flush=True)
            out.append({"model": model, "mode": "direct", "result": result})
    return out


def _direct_window(engine: Any, feed: dict[str, np.ndarray], expected: dict[str, np.ndarray], concurrency: int,
                   warmup: float, duration: float) -> LoadResult:
    """``concurrency`` threads call ``engine.infer`` back to back; calls inside the window are counted."""
    barrier = threading.Barrier(concurrency + 1)
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    errors = [0] * concurrency
    window: dict[str, float] = {}

    def worker(i: int) -> None:
        lat = latencies[i]
        barrier.wait()
        start, end = window["start"], window["end"]
        last: dict[str, np.ndarray] = {}
        while True:
            t0 = time.perf_counter()
            if t0 >= end:
                break
            try:
                last = engine.infer(feed)
            except Exception:  # counted, never raised: a failed call is not throughput
                errors[i] += 1
                continue
            t1 = time.perf_counter()
            if t0 >= start and t1 <= end:
                lat.append(t1 - t0)
        try:  # the last answer of every thread is checked too
            check_outputs(dict(last), expected, "direct")
        except AssertionError:
            errors[i] += 1

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    now = time.perf_counter()
    window["start"] = now + warmup
    window["end"] = now + warmup + duration
    barrier.wait()
    for t in threads:
        t.join(timeout=warmup + duration + 60)
    all_lat = np.asarray([x for lat in latencies for x in lat]) * 1e3
    ok = int(all_lat.size)
    return LoadResult("threads", concurrency, duration, ok, sum(errors), ok / duration,
                      float(np.percentile(all_lat, 50)) if ok else float("nan"),
                      float(np.percentile(all_lat, 99)) if ok else float("nan"),
                      float(all_lat.mean()) if ok else float("nan"))


def _served(tmp: Path, repo: Path, models: list[str], cases: dict[str, tuple[list[Tensor], dict[str, np.ndarray]]],
            modes: list[str], concurrencies: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    cmd = kiln_serve_cmd(repo, http_port, grpc_port, metrics_port)
    print(f"\n== kiln serve: {' '.join(cmd)}", flush=True)
    server = ServerProcess("kiln serve", cmd, tmp / "kiln-serve.log", env=project_env())
    out: list[dict[str, Any]] = []
    with running(server):
        ready_s = server.wait_http_ready(http_port, timeout=180)
        print(f"   ready after {ready_s:.2f} s", flush=True)
        pgid = server.proc.pid  # started in its own session: its pid is its process group
        for model in models:
            inputs, expected = cases[model]
            output_names = sorted(expected)
            for mode in modes:
                infer = f"/v2/models/{model}/infer"
                url = f"http://127.0.0.1:{http_port}{infer}"
                # Verify the exact request the load generator will send before measuring it.
                if mode == "http-json":
                    body, headers = json_body(inputs), {"Content-Type": "application/json"}
                    status, _h, resp = http_post(http_port, infer, body, headers)
                    _expect_200(status, resp, mode, model)
                    check_outputs(parse_json_response(resp), expected, f"{mode} {model}")
                elif mode == "http-binary":
                    body, headers = binary_body(inputs, output_names)
                    status, resp_headers, resp = http_post(http_port, infer, body, headers)
                    _expect_200(status, resp, mode, model)
                    length = resp_headers.get("inference-header-content-length")
                    if length is None:
                        raise AssertionError(f"{mode} {model}: response is not in the binary data extension")
                    check_outputs(parse_binary_response(resp, int(length)), expected, f"{mode} {model}")
                else:
                    message = grpc_request(model, inputs)
                    grpc_resp = grpc_unary(grpc_port, GRPC_INFER_PATH, message)
                    check_outputs(parse_grpc_response(grpc_resp), expected, f"{mode} {model}")
                for c in concurrencies:
                    wait_quiet(pgid, args.max_wait_quiet)
                    if mode == "grpc":
                        result = run_h2load(f"http://127.0.0.1:{grpc_port}", message, c, args.duration,
                                            args.warmup, expected_response_bytes=len(grpc_resp), server_pgid=pgid)
                    else:
                        run_wrk(url, body, headers, c, args.warmup, threads=args.wrk_threads)
                        result = run_wrk(url, body, headers, c, args.duration, threads=args.wrk_threads,
                                         server_pgid=pgid)
                    print(f"{mode:12s} {model:6s} c={c:<3d} {_fmt(result)}", flush=True)
                    out.append({"model": model, "mode": mode, "result": result})
        if server.proc.poll() is not None:
            raise RuntimeError(f"kiln serve died during the run:\n{server.log_tail()}")
    return out


def _expect_200(status: int, body: bytes, mode: str, model: str) -> None:
    if status != 200:
        raise AssertionError(f"{mode} {model}: HTTP {status}: {body[:500]!r}")


def _fmt(r: LoadResult) -> str:
    extra = f"  [{r.notes}]" if r.notes else ""
    return (f"{r.rps:9,.0f} req/s  p50 {r.p50_ms:7.3f} ms  p99 {r.p99_ms:7.3f} ms  ok {r.ok:6d}  errors {r.errors}"
            f"  cpu server/loadgen/other {r.cpu_server or 0:.2f}/{r.cpu_loadgen or 0:.2f}/{r.cpu_other or 0:.2f}"
            f"{extra}")


def _table(results: list[dict[str, Any]], models: list[str], modes: list[str], concurrencies: list[int]) -> list[str]:
    by_key = {(r["model"], r["mode"], r["result"].concurrency): r["result"] for r in results}
    rows = []
    for model in models:
        for mode in modes:
            for c in concurrencies:
                r = by_key.get((model, mode, c))
                if r is None:
                    continue
                d = by_key.get((model, "direct", c))
                rps_ratio = f"{r.rps / d.rps:.3f}" if d and d.rps and mode != "direct" else None
                p50_ratio = f"{r.p50_ms / d.p50_ms:.1f}x" if d and d.p50_ms and mode != "direct" else None
                rows.append([model, mode, c, r.rps, r.p50_ms, r.p99_ms, r.ok, r.errors, rps_ratio, p50_ratio,
                             _cores(r.cpu_server), _cores(r.cpu_loadgen), _cores(r.cpu_other)])
    lines = ["", "## Results (req/s counts only correct answers; latencies in ms; ratios served/direct)"]
    lines += format_table(["model", "mode", "conc", "req/s", "p50 ms", "p99 ms", "ok", "errors",
                           "req/s served/direct", "p50 served/direct", "cpu server", "cpu loadgen", "cpu other"], rows)
    lines += ["cpu columns: average cores busy during the window (server process group or, for direct, this "
              "process; load generator; all other processes on the machine)"]
    return lines


def _cores(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
