"""The request path, written once for the async caller (frontends) and the blocking one (scripts and tests without an
event loop): the steps before and after the scheduler are shared, the two entry points differ only in how they
wait for it.

Streams (:meth:`InferPath.infer_stream`) take the same steps; a decoupled model's responses then come one by one
(server/decoupled.py), each written into the request's output regions as it comes.

A request takes, in order: the shared-memory regions it names (inputs filled from them, the regions held), admission
(refused once shutdown began) to the version that serves it (named or routed) after validation against that
version's spec, the scheduler, then the routing counts and shadow mirror, its outputs written into their regions,
and last the regions let go.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Iterator

from kiln.errors import InvalidArgumentError, KilnError, UnavailableError, VersionUnloadingError
from kiln.server.catalog import ModelCatalog
from kiln.server.cuda_shm import RequestLeases
from kiln.server.decoupled import DecoupledScheduler, ResponseStream, StreamItem, unary_error
from kiln.server.regions import ClientRegions
from kiln.server.router import Router
from kiln.server.scheduler import Scheduler
from kiln.v2.types import InferRequest, InferResponse


class InferPath:
    def __init__(self, catalog: ModelCatalog, regions: ClientRegions, router: Router) -> None:
        self.catalog = catalog
        self.regions = regions
        self.router = router
        self.inflight = 0  # requests between their regions' attach and their answer
        self.stopping = False  # shutdown began: new requests are refused, admitted ones finish

    async def infer(self, request: InferRequest) -> InferResponse:
        try:
            with _Call(self, request, sync=False) as call:
                return await call.run()
        except InvalidArgumentError:
            self._refuse_decoupled(request)
            raise

    def infer_sync(self, request: InferRequest) -> InferResponse:
        try:
            with _Call(self, request, sync=True) as call:
                return call.run_sync()
        except InvalidArgumentError:
            self._refuse_decoupled(request)
            raise

    def _refuse_decoupled(self, request: InferRequest) -> None:
        """A one-response call to a decoupled model is refused for that, before what is wrong with its inputs (as
        Triton checks the model first); looked up only when the request failed, to spare the others."""
        try:
            found = self.catalog.resolve(request.model_name, request.model_version)
        except KilnError:
            return
        if isinstance(found.scheduler, DecoupledScheduler):
            raise unary_error(request.model_name, str(found.version)) from None

    async def infer_stream(self, request: InferRequest) -> AsyncGenerator[StreamItem, None]:
        """The request's answers: a decoupled model's responses as they come, any other model's one answer.
        Failures before the model runs (admission, validation) are raised from the first step."""
        with _Call(self, request, sync=False) as call:
            if not isinstance(call.scheduler, DecoupledScheduler):
                response = await call.run()
                yield StreamItem(response, final=True, model_version=response.model_version)
                return
            stream = call.open_stream(asyncio.get_running_loop())
            try:
                async for item in stream.items():
                    yield call.stream_answer(item)
            finally:
                stream.cancel()  # a no-op once the final response came

    def infer_stream_sync(self, request: InferRequest) -> Iterator[StreamItem]:
        """:meth:`infer_stream` for a blocking caller. The request is sent before this returns (a failure to send
        it is raised here); the iterator blocks for each answer."""
        call = _Call(self, request, sync=True).__enter__()
        if not isinstance(call.scheduler, DecoupledScheduler):
            try:
                response = call.run_sync()
                return iter([StreamItem(response, final=True, model_version=response.model_version)])
            finally:
                call.__exit__()
        try:
            stream = call.open_stream(None)
        except BaseException:
            call.__exit__()
            raise
        return _drain(call, stream)

    def admit(self, request: InferRequest) -> tuple[Scheduler, int]:
        if self.stopping:
            raise UnavailableError("the server is shutting down and takes no new requests")
        return self.router.admit(request)


class _Call:
    """One request on its way: entering attaches its regions and admits it to a scheduler, :meth:`answer` does what
    follows the scheduler's answer, leaving lets the regions go. (A class rather than a generator-based context
    manager: this runs for every request, and a generator costs microseconds more.)"""

    scheduler: Scheduler
    batch_size: int
    started_ns: int

    def __init__(self, path: InferPath, request: InferRequest, sync: bool) -> None:
        self.path = path
        self.request = request
        self.sync = sync
        self.leases: RequestLeases | None = None

    def __enter__(self) -> _Call:
        path = self.path
        path.inflight += 1
        try:
            self.leases = path.regions.attach(self.request, path.catalog.takes_device_tensors)
            self.started_ns = time.monotonic_ns()
            self.scheduler, self.batch_size = path.admit(self.request)
        except BaseException as exc:
            self.__exit__()
            if isinstance(exc, KilnError):
                exc.before_running = True
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.leases is not None:
            self.leases.release()
        self.path.inflight -= 1

    async def run(self) -> InferResponse:
        try:
            response = await self.scheduler.submit(self.request, self.batch_size)
        except VersionUnloadingError:
            self.readmit()
            response = await self.scheduler.submit(self.request, self.batch_size)
        return self.answer(response)

    def run_sync(self) -> InferResponse:
        try:
            response = self.scheduler.submit_sync(self.request, self.batch_size)
        except VersionUnloadingError:
            self.readmit()
            response = self.scheduler.submit_sync(self.request, self.batch_size)
        return self.answer(response)

    def open_stream(self, loop: asyncio.AbstractEventLoop | None) -> ResponseStream:
        """Send the request to its decoupled model; its responses come on the stream returned."""
        for attempt in (1, 2):
            scheduler = self.scheduler
            assert isinstance(scheduler, DecoupledScheduler)
            stream = ResponseStream(scheduler.model, self.request, self.batch_size, loop)
            try:
                scheduler.submit_stream(self.request, self.batch_size, stream)
                return stream
            except VersionUnloadingError:
                if attempt == 2:
                    raise
                self.readmit()
        raise AssertionError("unreachable")

    def stream_answer(self, item: StreamItem) -> StreamItem:
        """A streamed response's outputs go into their regions as it comes."""
        if item.response is not None and self.leases is not None:
            self.leases.finish(self.request, item.response)
        return item

    def readmit(self) -> None:
        """The version was swapped out between lookup and enqueue: its replacement takes the request."""
        self.scheduler, self.batch_size = self.path.admit(self.request)

    def answer(self, response: InferResponse) -> InferResponse:
        """After the scheduler answered: routing counts and shadow mirror, then outputs into their regions."""
        self.path.router.after_answer(self.request, response, self.started_ns, self.sync)
        if self.leases is not None:
            self.leases.finish(self.request, response)
        return response


def _drain(call: _Call, stream: ResponseStream) -> Iterator[StreamItem]:
    try:
        for item in stream.items_sync():
            yield call.stream_answer(item)
    finally:
        stream.cancel()
        call.__exit__()
