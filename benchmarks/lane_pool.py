"""Threads sharing a few lanes: kiln's LanePool (a lane given back goes to the longest waiting caller) next to a
pool that puts it back for anyone to take (kiln's before, a queue.SimpleQueue), side by side in one run. Needs no
GPU: each call holds its lane for some GIL-held work (staging, launching) and a GIL-free wait (the stream
synchronize), then does a little GIL-held work with its answer, as a direct caller of a GPU engine does.

    .venv/bin/python benchmarks/lane_pool.py [--lanes 8] [--threads 8,16,32] [--seconds 3]

Prints calls/s, the p50, p99 and longest call, and the fewest and most calls one thread made, per pool and thread
count (a thread that never got a lane makes one call, however long the run). On the GPU, the direct engine at c=16
(16 threads, 8 lanes) had a p99 of 105-127 ms against a mean near 6 ms (`kiln bench compare` on the H200).
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info

from kiln.engines.torch.lanes import LanePool


class PutBackPool:
    """The pool before: free lanes in a queue anyone may take from; waiters block on the queue."""

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


def measure(pool: Any, threads: int, seconds: float, held_us: float, device_us: float) -> str:
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

    return (f"{len(latencies) / seconds:8,.0f} calls/s, p50 {percentile(0.5):6.2f} ms, p99 {percentile(0.99):7.2f} ms, "
            f"longest {latencies[-1] * 1000:8.2f} ms, calls per thread {min(per_thread):,}-{max(per_thread):,}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--threads", default="8,16,32")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--held-us", type=float, default=60.0, help="GIL-held work per call while holding a lane")
    parser.add_argument("--device-us", type=float, default=900.0, help="GIL-free wait per call (the GPU's time)")
    args = parser.parse_args()
    machine = machine_info()
    print(f"machine: {machine['nproc']} cores, {machine['cpu_model']}, Python {machine['python']}, {machine['date']}")
    print(f"command: {' '.join(sys.argv)}")
    for threads in (int(t) for t in args.threads.split(",")):
        for name, pool in (("put back (before)", PutBackPool(lambda index: index, args.lanes)),
                           ("kiln LanePool", LanePool(lambda index: index, args.lanes))):
            line = measure(pool, threads, args.seconds, args.held_us, args.device_us)
            print(f"{threads:3d} threads, {args.lanes} lanes, {name:18s}: {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
