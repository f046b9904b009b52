"""Each request runs on its own on the next free instance; one worker thread per instance.

Engines release the GIL while they compute, so instances run in parallel. The event loop only awaits. Requests
from an event loop to engines that launch onto a device (PyTorch CUDA graphs) are launched from the loop instead,
one at a time per instance (scheduler/launched.py), which spares each the worker threads' waits for the GIL.
Blocking callers (``submit_sync``) keep the worker threads, so on such a model one of theirs may run beside an
instance's launched request, on another of its lanes.
"""

from __future__ import annotations

import asyncio
import queue
import time
from concurrent.futures import ThreadPoolExecutor

from kiln.batching.inline import InlineRunner
from kiln.batching.launched import LaunchRunner
from kiln.batching.policy import BatchingPolicy
from kiln.engines.base import Engine
from kiln.errors import InternalError, KilnError, VersionUnloadingError
from kiln.server.model import LoadedModel
from kiln.v2.types import InferRequest, InferResponse


class DirectScheduler:
    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        self._free: queue.SimpleQueue[Engine] = queue.SimpleQueue()
        for engine in model.engines:
            self._free.put(engine)
        self._executor = ThreadPoolExecutor(max_workers=len(model.engines),
                                            thread_name_prefix=f"kiln-{model.name}-{model.version}")
        self._inflight = 0
        self._threaded = 0
        self._closed = False
        self._inline = InlineRunner(model, 1, lambda request: None)
        # A batch of at most one row: the launcher never joins two requests, as no dynamic batching promises.
        self._launcher = LaunchRunner(model, BatchingPolicy(max_batch_size=1), lambda request: None)
        if self._launcher.active:
            self._inline.mode = "off"

    @property
    def inflight(self) -> int:
        return self._inflight + self._inline.inflight + self._launcher.inflight

    async def submit(self, request: InferRequest, batch_size: int) -> InferResponse:
        if self._closed:
            raise VersionUnloadingError(f"model '{self.model.name}' version {self.model.version} is unloading")
        if self._launcher.active:
            return await self._launcher.submit(request, batch_size)
        if self._inline.wanted() and not self._threaded:
            return await self._inline.submit(request, batch_size)
        loop = asyncio.get_running_loop()
        self._inflight += 1
        try:
            self._threaded += 1
            try:
                try:
                    future = loop.run_in_executor(self._executor, self._run, request, batch_size,
                                                  time.monotonic_ns())
                except RuntimeError:  # the executor shut down since the check above: the replacement takes it
                    raise VersionUnloadingError(f"model '{self.model.name}' version {self.model.version} is "
                                                f"unloading") from None
                return await future
            finally:
                self._threaded -= 1
        finally:
            self._inflight -= 1

    def submit_sync(self, request: InferRequest, batch_size: int) -> InferResponse:
        if self._closed:
            raise VersionUnloadingError(f"model '{self.model.name}' version {self.model.version} is unloading")
        return self._executor.submit(self._run, request, batch_size, time.monotonic_ns()).result()

    def _run(self, request: InferRequest, batch_size: int, enqueued_ns: int) -> InferResponse:
        engine = self._free.get()
        try:
            responses, times = self.model.run_batch(engine, [request], [batch_size])
        except BaseException as exc:  # count every failure; unexpected ones reach the client as INTERNAL
            self.model.stats.record_failure(time.monotonic_ns() - enqueued_ns)
            if isinstance(exc, KilnError):
                raise
            raise InternalError(f"model '{self.model.name}': {type(exc).__name__}: {exc}") from exc
        finally:
            self._free.put(engine)
        self._inline.observe(times)
        self.model.stats.record_success(times, [enqueued_ns], time.monotonic_ns())
        return responses[0]

    def close(self) -> None:
        """Stop taking requests, wait for the in-flight ones, then release the engines."""
        self._closed = True
        self._inline.close()  # refuse inline admissions, wait for the admitted ones
        self._launcher.close()  # ...and for the launched ones
        self._executor.shutdown(wait=True)
        self.model.close()
