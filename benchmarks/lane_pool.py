"""Threads sharing a few lanes: kiln's LanePool (a lane given back goes to the longest waiting caller) next to a
pool that puts a lane back for anyone to take (a queue.SimpleQueue), side by side in one run. Needs no GPU: each
call holds its lane for some GIL-held work (staging, launching) and a GIL-free wait (the stream synchronize), then
does a little GIL-held work with its answer, as a direct caller of a GPU engine does (a lane is a CUDA stream with
its graphs and buffers: docs/pytorch-backend.md, "Thread safety").

    python benchmarks/lane_pool.py [--lanes 8] [--threads 8,16,32] [--seconds 3] [--output results.txt]

Prints calls/s, the p50, p99 and longest call, and the fewest and most calls one thread made, per pool and thread
count. With the put-back pool, the thread that gives a lane back still holds the GIL and takes it again on its
next call, so waiting threads can starve: a thread that never got a lane makes one call, however long the run."""

from __future__ import annotations

import argparse
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from _common import describe, header, int_list, table

from kiln.engines.torch.lanes import LanePool


class PutBackPool:
    """Free lanes in a queue anyone may take from; waiters block on the queue."""

    def __init__(self, make: Callable[[int], Any], limit: int) -> None:
        self._free: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for index in range(limit):
            self._free.put(make(index))

    @contextlib.contextmanager
    def lane(self) -> Iterator[Any]:
        try:
            lane = self._free.get_nowait()
        except queue.Empty:
            lane = self._free.get()
        try:
            yield lane
        finally:
            self._free.put(lane)


def spin(us: float) -> None:
    """GIL-held work."""
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def measure(pool: Any, threads: int, seconds: float, held_us: float, device_us: float) -> dict[str, float]:
    latencies: list[float] = []
    per_thread: list[int] = []
    stop = time.perf_counter() + seconds

    def caller() -> None:
        mine = []
        while time.perf_counter() < stop:
            began = time.perf_counter()
            with pool.lane():
                spin(held_us)
                time.sleep(device_us / 1e6)
            spin(held_us / 2)
            mine.append(time.perf_counter() - began)
        latencies.extend(mine)
        per_thread.append(len(mine))

    workers = [threading.Thread(target=caller) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    latencies.sort()

    def percentile(q: float) -> float:
        return latencies[int(q * (len(latencies) - 1))] * 1000

    return {"calls_per_s": len(latencies) / seconds, "p50_ms": percentile(0.5), "p99_ms": percentile(0.99),
            "longest_ms": latencies[-1] * 1000, "fewest_calls": min(per_thread), "most_calls": max(per_thread)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--threads", default="8,16,32")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--held-us", type=float, default=60.0, help="GIL-held work per call while holding a lane")
    parser.add_argument("--device-us", type=float, default=900.0, help="GIL-free wait per call (the GPU's time)")
    parser.add_argument("--output", type=Path, default=None, help="write the text here too")
    args = parser.parse_args(argv)
    info = describe("Threads sharing lanes: kiln's LanePool vs a put-back pool (no GPU)",
                    settings=f"{args.lanes} lanes, {args.held_us:g} us GIL-held + {args.device_us:g} us GIL-free "
                             f"per call, {args.seconds:g} s per row")
    print(header(info), flush=True)
    rows: list[list[object]] = []
    for threads in int_list(args.threads):
        for name, pool in (("put back", PutBackPool(lambda index: index, args.lanes)),
                           ("kiln LanePool", LanePool(lambda index: index, args.lanes))):
            r = measure(pool, threads, args.seconds, args.held_us, args.device_us)
            rows.append([threads, name, r["calls_per_s"], r["p50_ms"], r["p99_ms"], r["longest_ms"],
                         f"{r['fewest_calls']:,}-{r['most_calls']:,}"])
            print(f"{threads:3d} threads, {name:18s}: {r}", flush=True)
    text = header(info) + "\n" + table(["threads", "pool", "calls/s", "p50 ms", "p99 ms", "longest ms",
                                         "calls per thread"], rows, numeric_from=2)
    print(text[len(header(info)):])
    if args.output is not None:
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
