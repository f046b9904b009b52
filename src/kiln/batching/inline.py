"""Run a fast model on the event loop thread instead of handing each request to a worker thread and back.

For a model that computes in microseconds the two thread hops cost more than the model. When a model's recent
executions are fast (``auto``, the default) and nothing is queued for the workers, requests that arrive in the same
event-loop turn are batched (up to max_batch_size, same shapes) and run right there. Slow models, busy workers,
and engines that are not safe to share between threads always take the worker path.

Per model: ``parameters { key: "inline_execution" value { string_value: "auto" | "on" | "off" } }``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable

from kiln.batching.admission import Admission
from kiln.batching.model import BatchModel, ExecutionTimes, arrivals, joined_counts
from kiln.errors import InternalError, InvalidArgumentError, KilnError
from kiln.v2.types import InferRequest, InferResponse

PARAMETER = "inline_execution"
FAST_NS = 300_000  # an execution (batch) this fast runs inline in auto mode
MIN_SAMPLES = 8  # executions seen before auto mode trusts its estimate

_Item = tuple[InferRequest, int, int, "asyncio.Future[InferResponse]", Hashable]


def inline_mode(model: BatchModel) -> str:
    mode = model.spec.parameters.get(PARAMETER, "auto") or "auto"
    if mode not in ("auto", "on", "off"):
        raise InvalidArgumentError(f"model '{model.name}': parameter '{PARAMETER}' is '{mode}'; expected auto, on "
                                   f"or off")
    engines_shareable = all(getattr(engine, "thread_safe", False) for engine in model.engines)
    return mode if engines_shareable or mode == "on" else "off"


class InlineRunner:
    def __init__(self, model: BatchModel, max_batch_size: int, signature: Callable[[InferRequest], Hashable]):
        self.model = model
        self.mode = inline_mode(model)
        self._max_rows = max(1, max_batch_size)
        self._signature = signature
        self._ewma_ns = 0.0
        self._samples = 0
        self._pending: list[_Item] = []
        self._scheduled = False
        self._admission = Admission(model.name, model.version)

    def observe(self, times: ExecutionTimes) -> None:
        """Learn how long executions take (called after every batch, from any thread; races only blur it)."""
        spent = times.compute_input_ns + times.compute_infer_ns + times.compute_output_ns
        self._ewma_ns = spent if not self._samples else 0.8 * self._ewma_ns + 0.2 * spent
        self._samples += 1

    def wanted(self) -> bool:
        if self.mode == "off":
            return False
        return self.mode == "on" or (self._samples >= MIN_SAMPLES and self._ewma_ns < FAST_NS)

    @property
    def inflight(self) -> int:
        return self._admission.inflight

    async def submit(self, request: InferRequest, rows: int) -> InferResponse:
        with self._admission:
            loop = asyncio.get_running_loop()
            future: asyncio.Future[InferResponse] = loop.create_future()
            self._pending.append((request, rows, time.monotonic_ns(), future, self._signature(request)))
            if not self._scheduled:
                self._scheduled = True
                loop.call_soon(self._flush)
            return await future

    def close(self, timeout_s: float = 60.0) -> None:
        """Refuse new requests, then wait (from another thread) for the admitted ones to finish."""
        self._admission.close(timeout_s)

    def _flush(self) -> None:
        self._scheduled = False
        items = [item for item in self._pending if not item[3].done()]
        self._pending = []
        while items:
            batch = [items.pop(0)]
            rows = batch[0][1]
            while items and items[0][4] == batch[0][4] and rows + items[0][1] <= self._max_rows:
                rows += items[0][1]
                batch.append(items.pop(0))
            self._run(batch)

    def _run(self, batch: list[_Item]) -> None:
        try:
            engine = self.model.engines[0]
            responses, times = self.model.run_batch(engine, [item[0] for item in batch], [item[1] for item in batch])
        except BaseException as exc:  # each request of the batch gets the error; the loop carries on
            error = exc if isinstance(exc, KilnError) else InternalError(f"model '{self.model.name}': {exc}")
            now = time.monotonic_ns()
            for item in batch:
                self.model.stats.record_failure(now - item[2], requests=item[0].members)
                if not item[3].done():
                    item[3].set_exception(error)
            return
        self.observe(times)
        self.model.stats.record_success(times, arrivals((item[2], item[0]) for item in batch), time.monotonic_ns(),
                                        joined_counts(item[0] for item in batch))
        for item, response in zip(batch, responses, strict=True):
            if not item[3].done():
                item[3].set_result(response)
