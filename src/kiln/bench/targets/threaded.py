"""Load loops for blocking calls: a thread per request slot.

Concurrency N runs N threads, each sending its next request as soon as the last one answered. Request-rate mode
runs a dispatcher thread on the pacer's clock that hands each due send to the lowest idle slot's thread, or drops
it when all ``max_outstanding`` slots are busy. Blocking calls that release the GIL (onnxruntime, torch) then run
in parallel, and no event loop sits between the caller and the engine.
"""

from __future__ import annotations

import abc
import itertools
import logging
import queue
import threading
import time

from kiln.bench.data import Request
from kiln.bench.records import ClientTimes, Level, Recorder, RequestRecord
from kiln.bench.schedule import Pacer, SendCounts, SlotPool
from kiln.bench.targets.base import STOP_TIMEOUT_S, Target

log = logging.getLogger("kiln.bench")

_MAX_WAIT_S = 0.05  # the dispatcher wakes at least this often to notice a stop


class ThreadedTarget(Target):
    """A target whose requests are blocking calls; subclasses implement :meth:`infer`."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._counts: SendCounts | None = None
        self._recorder = Recorder()
        self._next = itertools.count()
        self._failed = False

    @abc.abstractmethod
    def infer(self, slot: int, request: Request) -> ClientTimes | None:
        """Send one request from ``slot`` and wait for its answer; raise on failure."""

    def ensure_slots(self, count: int) -> None:  # optional hook, most targets need nothing per slot
        """Called before a level starts with the number of slots it may use (per-slot resources go here)."""

    def check(self) -> None:
        self.ensure_slots(1)
        self.infer(0, self.requests[0])

    def start(self, level: Level, recorder: Recorder) -> None:
        self._stop.clear()
        self._recorder = recorder
        self._counts = None
        self._failed = False
        if level.concurrency is not None:
            self.ensure_slots(level.concurrency)
            self._threads = [threading.Thread(target=self._closed_loop, args=(slot,), daemon=True,
                                              name=f"kiln-bench-{slot}") for slot in range(level.concurrency)]
        else:
            self.ensure_slots(level.max_outstanding)
            self._threads = [threading.Thread(target=self._dispatch, args=(level,), daemon=True,
                                              name="kiln-bench-dispatch")]
        for thread in self._threads:
            thread.start()

    def stop(self) -> SendCounts | None:
        self._stop.set()
        for thread in self._threads:
            thread.join(STOP_TIMEOUT_S)
        self._threads = []
        return self._counts

    def _send(self, slot: int) -> None:
        request = self.requests[next(self._next) % len(self.requests)]
        recorder = self._recorder  # the level this request belongs to, even if it ends after the level stopped
        start = time.monotonic_ns()
        try:
            client = self.infer(slot, request)
        except Exception as exc:  # every failure is counted; the first one of a level is shown
            if not self._failed:
                self._failed = True
                log.warning("kiln bench: a request failed (%s: %s)", type(exc).__name__, exc)
            recorder.add(RequestRecord(start, time.monotonic_ns(), False, None))
            return
        recorder.add(RequestRecord(start, time.monotonic_ns(), True, client))

    def _closed_loop(self, slot: int) -> None:
        while not self._stop.is_set():
            self._send(slot)

    def _dispatch(self, level: Level) -> None:
        assert level.request_rate is not None
        pool = SlotPool(level.max_outstanding)
        pacer = Pacer(level.request_rate, level.distribution, time.monotonic_ns(), level.seed)
        workers: dict[int, tuple[queue.SimpleQueue[bool], threading.Thread]] = {}
        while not self._stop.is_set():
            wait_ns = pacer.wait_ns(time.monotonic_ns())
            if wait_ns > 0:
                self._stop.wait(min(wait_ns / 1e9, _MAX_WAIT_S))
                continue
            slot = pool.acquire()
            if pacer.take(time.monotonic_ns(), slot is not None) is None or slot is None:
                continue
            if slot not in workers:
                jobs: queue.SimpleQueue[bool] = queue.SimpleQueue()
                thread = threading.Thread(target=self._slot_worker, args=(slot, jobs, pool), daemon=True,
                                          name=f"kiln-bench-{slot}")
                thread.start()
                workers[slot] = (jobs, thread)
            workers[slot][0].put(True)
        for jobs, _ in workers.values():
            jobs.put(False)
        for _, thread in workers.values():
            thread.join(STOP_TIMEOUT_S)
        self._counts = pacer.counts()

    def _slot_worker(self, slot: int, jobs: queue.SimpleQueue[bool], pool: SlotPool) -> None:
        while jobs.get():
            try:
                self._send(slot)
            finally:
                pool.release(slot)
