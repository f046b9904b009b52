"""Decoupled models (``model_transaction_policy { decoupled: true }``): a request is answered by a stream of zero
or more responses, sent by the model from any thread, ended by a final flag.

:class:`DecoupledScheduler` runs such a model: a free instance takes the waiting requests (one, or with
``dynamic_batching`` as many whole requests as ``max_batch_size`` rows allow, each with its own response sender, as
Triton's Python backend hands them over) and calls the engine's ``execute_decoupled``; the instance is free again
as soon as ``execute`` returns, while responses may still come. :class:`ResponseStream` carries one request's
responses to whoever consumes them (an event loop or a blocking thread) and records Triton's per-response
statistics (``response_stats``, keyed by the response's index within its request).

A request's own statistics (success, queue, compute) are counted when ``execute`` returns, as Triton's Python
backend reports them; a failed ``execute`` counts every request it held as failed. One-response calls
(HTTP ``/infer``, gRPC ``ModelInfer``, ``Server.infer``) raise :class:`DecoupledModelError`; frontends answer it in
Triton's words.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy.typing as npt

from kiln.batching.model import ExecutionTimes
from kiln.engines.base import Engine
from kiln.engines.python.decoupled import DecoupledCall
from kiln.errors import InternalError, KilnError, UnsupportedError, VersionUnloadingError
from kiln.server.model import LoadedModel
from kiln.v2.types import InferRequest, InferResponse

Array = npt.NDArray[Any]


class DecoupledModelError(UnsupportedError):
    """A one-response call (unary infer) to a decoupled model."""


@dataclass(frozen=True)
class StreamItem:
    """One answer on a request's stream: a response, or an error, or neither (the final flag alone). ``final`` ends
    the request's stream; ``model_version`` is the version that answered."""

    response: InferResponse | None
    error: KilnError | None = None
    final: bool = False
    model_version: str = ""


class _DecoupledEngine(Protocol):
    def execute_decoupled(self, calls: list[DecoupledCall]) -> None: ...


class ResponseStream:
    """One request's responses, put by the model's threads and taken by one consumer: :meth:`items` on the event
    loop ``loop``, or :meth:`items_sync` on a blocking thread (``loop`` None). :meth:`cancel` says the consumer is
    gone: later responses are dropped, :meth:`cancelled` tells the model."""

    def __init__(self, model: LoadedModel, request: InferRequest, rows: int,
                 loop: asyncio.AbstractEventLoop | None) -> None:
        self._model = model
        self._request = request
        self._rows = rows
        self._loop = loop
        self._async_items: asyncio.Queue[StreamItem] | None = asyncio.Queue() if loop is not None else None
        self._sync_items: queue.SimpleQueue[StreamItem] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._index = 0  # the index of the next response (response_stats key)
        self._mark_ns = time.monotonic_ns()  # where the next response's compute time starts
        self._ended = False
        self._cancelled = False
        self.on_end: Callable[[], None] = lambda: None

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def started(self, start_ns: int) -> None:
        """``execute`` began: the first response's compute time counts from here."""
        self._mark_ns = start_ns

    def put(self, outputs: Mapping[str, Array] | None, error: KilnError | None, final: bool) -> None:
        begin_ns = time.monotonic_ns()
        with self._lock:
            if self._ended:
                return
            self._ended = final
            index, self._index = self._index, self._index + 1
            dropped = self._cancelled
        if not dropped:
            item = self._item(outputs, error, final)
            end_ns = time.monotonic_ns()
            self._record(index, item, begin_ns, end_ns)
            self._deliver(item)
        if final:
            self.on_end()

    def cancel(self) -> None:
        """The consumer went away before the final response."""
        with self._lock:
            if self._ended or self._cancelled:
                return
            self._cancelled = True
            index = self._index
        now = time.monotonic_ns()
        self._model.stats.record_response(index, "cancel", 0, 0)
        self._mark_ns = now

    async def items(self) -> AsyncIterator[StreamItem]:
        assert self._async_items is not None
        while True:
            item = await self._async_items.get()
            yield item
            if item.final:
                return

    def items_sync(self) -> Iterator[StreamItem]:
        while True:
            item = self._sync_items.get()
            yield item
            if item.final:
                return

    def _item(self, outputs: Mapping[str, Array] | None, error: KilnError | None, final: bool) -> StreamItem:
        version = str(self._model.version)
        if error is not None:
            return StreamItem(None, error, final, version)
        if outputs is None:
            return StreamItem(None, None, final, version)
        try:
            response = self._model.responses([self._request], [self._rows], dict(outputs))[0]
        except KilnError as exc:
            return StreamItem(None, exc, final, version)
        return StreamItem(response, None, final, version)

    def _record(self, index: int, item: StreamItem, begin_ns: int, end_ns: int) -> None:
        infer_ns, output_ns = max(0, begin_ns - self._mark_ns), end_ns - begin_ns
        self._mark_ns = end_ns
        if item.error is not None:
            self._model.stats.record_response(index, "fail", infer_ns, output_ns)
        elif item.response is not None:
            self._model.stats.record_response(index, "success", infer_ns, output_ns)
        else:
            self._model.stats.record_response(index, "empty", infer_ns, 0)

    def _deliver(self, item: StreamItem) -> None:
        if self._loop is None:
            self._sync_items.put(item)
            return
        assert self._async_items is not None
        try:
            self._loop.call_soon_threadsafe(self._async_items.put_nowait, item)
        except RuntimeError:  # the loop closed (server shut down): nobody is left to read it
            pass


@dataclass
class _Waiting:
    request: InferRequest
    rows: int
    stream: ResponseStream
    enqueued_ns: int


class DecoupledScheduler:
    """Runs a decoupled model's requests on its instances; see the module docstring."""

    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        self._free: queue.SimpleQueue[Engine] = queue.SimpleQueue()
        for engine in model.engines:
            self._free.put(engine)
        self._waiting: collections.deque[_Waiting] = collections.deque()
        self._executor = ThreadPoolExecutor(max_workers=len(model.engines),
                                            thread_name_prefix=f"kiln-{model.name}-{model.version}")
        batching = model.spec.config.HasField("dynamic_batching")
        self._max_rows = max(1, model.spec.max_batch_size) if batching else 0  # 0: one request per execute
        self._lock = threading.Lock()
        self._open = 0  # requests accepted whose final response has not come
        self._closed = False

    @property
    def inflight(self) -> int:
        return self._open

    async def submit(self, request: InferRequest, batch_size: int) -> InferResponse:
        raise unary_error(self.model.name, str(self.model.version))

    def submit_sync(self, request: InferRequest, batch_size: int) -> InferResponse:
        raise unary_error(self.model.name, str(self.model.version))

    def submit_stream(self, request: InferRequest, batch_size: int, stream: ResponseStream) -> None:
        """Queue ``request``; its responses go to ``stream``."""
        if self._closed:
            raise VersionUnloadingError(f"model '{self.model.name}' version {self.model.version} is unloading")
        with self._lock:
            self._open += 1
        stream.on_end = self._stream_ended
        with self._lock:
            self._waiting.append(_Waiting(request, batch_size, stream, time.monotonic_ns()))
        try:
            self._executor.submit(self._run)
        except RuntimeError:  # shut down since the check above: the replacement version takes it
            self._stream_ended()
            raise VersionUnloadingError(f"model '{self.model.name}' version {self.model.version} is "
                                        f"unloading") from None

    def close(self) -> None:
        """Stop taking requests and wait for the running ``execute`` calls, then release the engines (a model's
        finalize may wait for the responses its threads still send)."""
        self._closed = True
        self._executor.shutdown(wait=True)
        self.model.close()

    def _stream_ended(self) -> None:
        with self._lock:
            self._open -= 1

    def _run(self) -> None:
        engine = self._free.get()
        try:
            batch = self._take()
            if batch:
                self._execute(engine, batch)
        finally:
            self._free.put(engine)

    def _take(self) -> list[_Waiting]:
        """The waiting requests the next execute gets: the first one, and with dynamic batching the next ones while
        their rows fit in ``max_batch_size``."""
        with self._lock:
            if not self._waiting:
                return []
            batch = [self._waiting.popleft()]
            rows = batch[0].rows
            while self._waiting and rows + self._waiting[0].rows <= self._max_rows:
                rows += self._waiting[0].rows
                batch.append(self._waiting.popleft())
            return batch

    def _execute(self, engine: Engine, batch: list[_Waiting]) -> None:
        start_ns = time.monotonic_ns()
        for waiting in batch:
            waiting.stream.started(start_ns)
        calls = [DecoupledCall({t.name: t.data for t in w.request.inputs}, self._output_names(w.request), w.stream)
                 for w in batch]
        runner: _DecoupledEngine = engine  # type: ignore[assignment]  # only Python engines load as decoupled
        try:
            runner.execute_decoupled(calls)
        except BaseException as exc:  # every request counts as failed; their streams got the error already
            end_ns = time.monotonic_ns()
            for waiting in batch:
                self.model.stats.record_failure(end_ns - waiting.enqueued_ns)
            if not isinstance(exc, KilnError):
                error = InternalError(f"model '{self.model.name}': {type(exc).__name__}: {exc}")
                for waiting in batch:
                    waiting.stream.put(None, error, True)
            return
        end_ns = time.monotonic_ns()
        times = ExecutionTimes(sum(w.rows for w in batch), start_ns, 0, end_ns - start_ns, 0)
        self.model.stats.record_success(times, [w.enqueued_ns for w in batch], end_ns)

    def _output_names(self, request: InferRequest) -> list[str]:
        if request.outputs:
            wanted = {o.name for o in request.outputs}
            return [t.name for t in self.model.spec.outputs if t.name in wanted]
        return [t.name for t in self.model.spec.outputs]


def unary_error(model: str, version: str) -> DecoupledModelError:
    """The error of a one-response call to a decoupled model (frontends answer it in Triton's words)."""
    return DecoupledModelError(
        f"model '{model}' version {version} is decoupled (model_transaction_policy decoupled: true): it may send "
        f"any number of responses per request, so it is called through a stream (gRPC ModelStreamInfer, HTTP "
        f"generate_stream, InferenceRequest.exec(decoupled=True))")
