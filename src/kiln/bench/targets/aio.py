"""Load loops for asynchronous clients: one event loop in a background thread, a task per request slot.

Concurrency N runs N tasks, each awaiting its next request as soon as the last one answered. Request-rate mode
runs a dispatcher task on the pacer's clock that starts a task for each due send on the lowest idle slot, or
drops the send when all ``max_outstanding`` slots are busy. The loop is uvloop's when it is installed (as in
``kiln serve``). The measurement thread reaches the loop only through :meth:`AsyncTarget._call`.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from kiln.bench.data import ModelInputs, Request
from kiln.bench.records import ClientTimes, Level, Recorder, RequestRecord
from kiln.bench.schedule import Pacer, SendCounts, SlotPool
from kiln.bench.server_stats import ServerCounters
from kiln.bench.targets.base import REQUEST_TIMEOUT_S, STOP_TIMEOUT_S, Target

log = logging.getLogger("kiln.bench")
T = TypeVar("T")

_MAX_WAIT_S = 0.05  # the dispatcher wakes at least this often to notice a stop


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class AsyncTarget(Target):
    """A target whose requests are coroutines; subclasses implement :meth:`aopen` and :meth:`ainfer`."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._running: concurrent.futures.Future[SendCounts | None] | None = None
        self._recorder = Recorder()
        self._next = itertools.count()
        self._failed = False

    @abc.abstractmethod
    async def aopen(self) -> ModelInputs: ...

    @abc.abstractmethod
    async def ainfer(self, slot: int, request: Request) -> ClientTimes | None:
        """Send one request from ``slot`` and await its answer; raise on failure."""

    async def astats(self) -> ServerCounters | None:
        return None

    async def aclose(self) -> None:  # optional hook
        """Release connections; called on the loop, also after a failed open."""

    def open(self) -> ModelInputs:
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kiln-bench-loop", daemon=True)
        self._thread.start()
        return self._call(self.aopen())

    def check(self) -> None:
        self._call(self.ainfer(0, self.requests[0]), REQUEST_TIMEOUT_S)

    def start(self, level: Level, recorder: Recorder) -> None:
        assert self._loop is not None, "open() first"
        self._stop.clear()
        self._recorder = recorder
        self._failed = False
        self._running = asyncio.run_coroutine_threadsafe(self._drive(level), self._loop)

    def stop(self) -> SendCounts | None:
        self._stop.set()
        running, self._running = self._running, None
        return running.result(STOP_TIMEOUT_S) if running is not None else None

    def server_stats(self) -> ServerCounters | None:
        return self._call(self.astats(), REQUEST_TIMEOUT_S)

    def close(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            self._call(self.aclose(), STOP_TIMEOUT_S)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(STOP_TIMEOUT_S)
            loop.close()
            self._loop = self._thread = None

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        assert self._loop is not None, "open() first"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _drive(self, level: Level) -> SendCounts | None:
        if level.concurrency is not None:
            await asyncio.gather(*(self._closed_loop(slot) for slot in range(level.concurrency)))
            return None
        return await self._dispatch(level)

    async def _send(self, slot: int) -> None:
        request = self.requests[next(self._next) % len(self.requests)]
        recorder = self._recorder  # the level this request belongs to, even if it ends after the level stopped
        start = time.monotonic_ns()
        try:
            client = await self.ainfer(slot, request)
        except Exception as exc:  # every failure is counted; the first one of a level is shown
            if not self._failed:
                self._failed = True
                log.warning("kiln bench: a request failed (%s: %s)", type(exc).__name__, exc)
            recorder.add(RequestRecord(start, time.monotonic_ns(), False, None))
            return
        recorder.add(RequestRecord(start, time.monotonic_ns(), True, client))

    async def _closed_loop(self, slot: int) -> None:
        while not self._stop.is_set():
            await self._send(slot)

    async def _send_on(self, slot: int, pool: SlotPool) -> None:
        try:
            await self._send(slot)
        finally:
            pool.release(slot)

    async def _dispatch(self, level: Level) -> SendCounts:
        assert level.request_rate is not None
        pool = SlotPool(level.max_outstanding)
        pacer = Pacer(level.request_rate, level.distribution, time.monotonic_ns(), level.seed)
        tasks: set[asyncio.Task[None]] = set()
        while not self._stop.is_set():
            wait_ns = pacer.wait_ns(time.monotonic_ns())
            if wait_ns > 0:
                await asyncio.sleep(min(wait_ns / 1e9, _MAX_WAIT_S))
                continue
            slot = pool.acquire()
            if pacer.take(time.monotonic_ns(), slot is not None) is not None and slot is not None:
                task = asyncio.create_task(self._send_on(slot, pool))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.sleep(0)  # let a send start (or a busy slot finish) before the next one is due
        await asyncio.gather(*tasks)
        return pacer.counts()
