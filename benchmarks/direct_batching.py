"""The direct engine with and without batching: callers on one ``kiln.load``'d engine, one row per call.

With ``batching=True`` (the default for a GPU engine whose config has ``dynamic_batching``) concurrent calls are
coalesced into batches by the batching core the server uses; with ``batching=False`` each call runs on its own.
Callers are threads calling ``engine.infer`` or coroutines on one event loop awaiting ``engine.ainfer``
(``--calls``). For every caller count each combination is measured in turn on the same model: calls/s, p50/p99
latency of a call, the average batch the engine executed, the process's CPU and its busiest threads by name (on a
GPU the thread that waits for the device, ``kiln-<model>-<version>-launched``). Answers are checked against a
single unbatched call.

    python benchmarks/direct_batching.py --model mlp --threads 1,4,16 --seconds 5 \\
        --output benchmarks/results/direct-batching-<date>.json
    python benchmarks/direct_batching.py --model /tmp/gpu16/resnet50 --threads 16,64 --calls threads,asyncio \\
        --batching on --seconds 3
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from _common import describe, header, int_list, str_list, table, write_outputs

import kiln
from kiln.demo import build_demo_repository
from kiln.direct import BatchingEngine
from kiln.engines.base import Engine

BUSIEST_SHOWN = 3


class ThreadCpu:
    """CPU seconds per wall second of this process and of its threads by name, between start() and stop()."""

    def __init__(self) -> None:
        self._process = psutil.Process()

    def start(self) -> None:
        self._at, self._total, self._threads = self._read()

    def stop(self) -> tuple[float, list[tuple[str, float]]]:
        """The process's cores, and every thread group's, busiest first."""
        at, total, threads = self._read()
        wall = at - self._at
        names = {thread.native_id: thread.name for thread in threading.enumerate()}
        per_name: dict[str, float] = {}
        for tid, spent in threads.items():
            name = _group(names.get(tid, "native"))  # native: threads Python did not start (ONNX Runtime's, CUDA's)
            per_name[name] = per_name.get(name, 0.0) + (spent - self._threads.get(tid, 0.0)) / wall
        ranked = sorted(per_name.items(), key=lambda item: -item[1])
        return round((total - self._total) / wall, 2), [(name, round(cores, 2)) for name, cores in ranked]

    def _read(self) -> tuple[float, float, dict[int, float]]:
        with self._process.oneshot():
            times = self._process.cpu_times()
            threads = {t.id: t.user_time + t.system_time for t in self._process.threads()}
        return time.monotonic(), times.user + times.system, threads


def _group(name: str) -> str:
    """Threads that each add little on their own, counted together: the callers, the executor of asyncio.to_thread."""
    if name.startswith("Thread-"):
        return "callers"
    return "asyncio executor" if name.startswith("asyncio_") else name


def run_threads(engine: Engine, inputs: list[dict[str, Any]], start_at: float, stop_at: float,
                latencies: list[list[int]], last: list[Any], window: Window) -> None:
    def caller(index: int) -> None:
        while not window.closed.is_set():  # calling on until the window has closed: it closes under the same load
            now = time.monotonic()
            began = time.perf_counter_ns()
            last[index] = engine.infer(inputs[index])
            if start_at <= now < stop_at:
                latencies[index].append(time.perf_counter_ns() - began)

    workers = [threading.Thread(target=caller, args=(i,)) for i in range(len(inputs))]
    for worker in workers:
        worker.start()
    time.sleep(max(0.0, start_at - time.monotonic()))
    window.opens()
    time.sleep(max(0.0, stop_at - time.monotonic()))
    window.closes()
    for worker in workers:
        worker.join()


def run_coroutines(engine: Engine, inputs: list[dict[str, Any]], start_at: float, stop_at: float,
                   latencies: list[list[int]], last: list[Any], window: Window) -> None:
    async def caller(index: int) -> None:
        while not window.closed.is_set():
            now = time.monotonic()
            began = time.perf_counter_ns()
            last[index] = await engine.ainfer(inputs[index])
            if start_at <= now < stop_at:
                latencies[index].append(time.perf_counter_ns() - began)

    async def main() -> None:
        callers = asyncio.gather(*(caller(i) for i in range(len(inputs))))
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        window.opens()
        await asyncio.sleep(max(0.0, stop_at - time.monotonic()))
        window.closes()
        await callers

    asyncio.run(main())


class Window:
    """The measured window's CPU and the engine's average batch over it."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._cpu = ThreadCpu()
        self._batches = (0, 0)
        self.average_batch = 1.0
        self.process_cores = 0.0
        self.threads: list[tuple[str, float]] = []  # every thread group, busiest first
        self.closed = threading.Event()  # the callers stop once it is set, so their threads are counted by name

    def opens(self) -> None:
        self._cpu.start()
        self._batches = self._counts()

    def closes(self) -> None:
        try:
            self.process_cores, self.threads = self._cpu.stop()
        finally:
            self.closed.set()  # the callers stop whatever happened here
        executions, inferences = self._counts()
        if isinstance(self._engine, BatchingEngine):
            self.average_batch = (inferences - self._batches[1]) / max(1, executions - self._batches[0])

    def _counts(self) -> tuple[int, int]:
        if not isinstance(self._engine, BatchingEngine):
            return 0, 0
        return self._engine.batch_log.executions, self._engine.batch_log.inferences


CALLS = {"threads": run_threads, "asyncio": run_coroutines}


def measure(model_dir: Path, calls: str, batching: bool, callers: int, seconds: float,
            warmup: float) -> dict[str, Any]:
    """``callers`` on one engine for ``seconds`` (after ``warmup``): calls/s, latency, average batch, CPU."""
    with kiln.load(model_dir, batching=batching) as engine:
        spec = engine.inputs[0]
        rng = np.random.default_rng(7)
        dtype = spec.datatype.numpy_dtype
        inputs = [{spec.name: rng.standard_normal((1, *spec.dims)).astype(dtype)} for _ in range(callers)]
        # batched fp16 kernels may pick other algorithms than batch 1: compare at the type's precision
        rtol, atol = (2e-2, 2e-2) if dtype.itemsize < 4 else (1e-5, 1e-6)
        expected = [engine.infer(each) for each in inputs]
        latencies: list[list[int]] = [[] for _ in range(callers)]
        last: list[Any] = [None] * callers
        start_at = time.monotonic() + warmup
        window = Window(engine)
        CALLS[calls](engine, inputs, start_at, start_at + seconds, latencies, last, window)
        for answer, wanted in zip(last, expected, strict=True):  # each caller's last answer, checked once
            for name, value in wanted.items():
                np.testing.assert_allclose(answer[name], value, rtol=rtol, atol=atol)
        times = np.array([ns for per_caller in latencies for ns in per_caller], dtype=np.int64)
    return {"calls": calls, "batching": batching, "threads": callers, "calls_per_s": len(times) / seconds,
            "p50_ms": float(np.percentile(times, 50)) / 1e6 if len(times) else None,
            "p99_ms": float(np.percentile(times, 99)) / 1e6 if len(times) else None,
            "average_batch": window.average_batch, "process_cores": window.process_cores,
            "busiest_threads": window.threads[:BUSIEST_SHOWN], "thread_cores": dict(window.threads)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp", help="a model of the demo repository, or a model folder")
    parser.add_argument("--threads", default="1,4,16", help="caller counts (threads, or coroutines with asyncio)")
    parser.add_argument("--calls", default="threads", help="threads (engine.infer), asyncio (engine.ainfer), or both")
    parser.add_argument("--batching", default="on,off", help="on, off, or both")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--output", type=Path, default=None, help="JSON results (a .txt beside it gets the text)")
    args = parser.parse_args(argv)
    calls, batching = str_list(args.calls), str_list(args.batching)
    if unknown := [each for each in calls if each not in CALLS] + [b for b in batching if b not in ("on", "off")]:
        parser.error(f"unknown --calls or --batching value(s) {', '.join(unknown)}; expected "
                     f"{', '.join(CALLS)} and on, off")

    info = describe(f"kiln.load() from many callers: batching on vs off ({args.model})")
    print(header(info), flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-direct-batching-") as tmp:
        model_dir = Path(args.model)
        if not model_dir.is_dir():
            build_demo_repository(Path(tmp), include_resnet50=args.model == "resnet50")
            model_dir = Path(tmp) / args.model
        for callers in int_list(args.threads):
            for how in calls:
                for on in batching:
                    row = measure(model_dir, how, on == "on", callers, args.seconds, args.warmup)
                    rows.append(row)
                    print(f"{how} x{callers} batching={on}: {row['calls_per_s']:.0f} calls/s", flush=True)
    text = table(["callers", "calls", "batching", "calls/s", "p50 ms", "p99 ms", "average batch", "process cores",
                  "busiest threads (cores)"],
                 [[r["threads"], r["calls"], "on" if r["batching"] else "off", r["calls_per_s"], r["p50_ms"],
                   r["p99_ms"], r["average_batch"], r["process_cores"],
                   ", ".join(f"{name} {cores:.2f}" for name, cores in r["busiest_threads"])] for r in rows])
    print(text)
    write_outputs(args.output, {"info": info, "rows": rows}, header(info) + "\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
