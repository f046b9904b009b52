"""The request path, written once for the async caller (frontends) and the blocking one (scripts and tests without an
event loop): the steps before and after the scheduler are shared, the two entry points differ only in how they
wait for it.

A request takes, in order: the shared-memory regions it names (inputs filled from them, the regions held), admission
(refused once shutdown began) to the version that serves it (named or routed) after validation against that
version's spec, the scheduler, then the routing counts and shadow mirror, its outputs written into their regions,
and last the regions let go.
"""

from __future__ import annotations

import time

from kiln.errors import UnavailableError, VersionUnloadingError
from kiln.server.catalog import ModelCatalog
from kiln.server.cuda_shm import RequestLeases
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
        with _Call(self, request, sync=False) as call:
            try:
                response = await call.scheduler.submit(request, call.batch_size)
            except VersionUnloadingError:
                call.readmit()
                response = await call.scheduler.submit(request, call.batch_size)
            return call.answer(response)

    def infer_sync(self, request: InferRequest) -> InferResponse:
        with _Call(self, request, sync=True) as call:
            try:
                response = call.scheduler.submit_sync(request, call.batch_size)
            except VersionUnloadingError:
                call.readmit()
                response = call.scheduler.submit_sync(request, call.batch_size)
            return call.answer(response)

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
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.leases is not None:
            self.leases.release()
        self.path.inflight -= 1

    def readmit(self) -> None:
        """The version was swapped out between lookup and enqueue: its replacement takes the request."""
        self.scheduler, self.batch_size = self.path.admit(self.request)

    def answer(self, response: InferResponse) -> InferResponse:
        """After the scheduler answered: routing counts and shadow mirror, then outputs into their regions."""
        self.path.router.after_answer(self.request, response, self.started_ns, self.sync)
        if self.leases is not None:
            self.leases.finish(self.request, response)
        return response
