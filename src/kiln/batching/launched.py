"""Batches launched from the event loop onto engines that finish on a device (PyTorch CUDA graph lanes).

With a worker thread per instance, each batch crosses between the loop and a worker twice, and a worker that waits
for the GPU without the GIL must then wait for the busy loop to give the GIL back, up to the interpreter's switch
interval each time. Here the event loop itself forms a batch from the requests waiting on it, stages it into a
free lane of an instance that has no batch out and queues it on the GPU (``Engine.launch_parts``), then goes on
serving; one waiter thread blocks on the device and hands each finished batch back to its loop, which collects the
outputs, answers, and launches what arrived meanwhile. Batches of different instances overlap: one batch's copies
and kernels run while the loop answers another's callers and stages the next.

Per model: ``parameters { key: "launch_execution" value { string_value: "auto" | "off" } }``. ``auto`` (the
default) launches whenever every instance can and the batching policy needs no queue: no queue delay, one
priority level, no queue policies (timeouts, queue sizes), no preserve_ordering (which orders answers across
loops and workers). Otherwise requests take the worker path.

While a batch of the model is on the device, another instance starts a batch only once it has
``launch_overlap_rows`` rows (default: the smallest preferred batch size, else an eighth of max_batch_size);
fewer wait for the batch out to come back and leave with what arrived meanwhile. Requests from the network arrive
spread over many loop turns: launching each turn's one or two onto the idle instance would keep the device busy
with batches of one, each costing a launch on the loop. Only under load, though: when the rows out and waiting
together reach ``launch_overlap_rows``, or when the loop's thread is busy (kiln.batching.loop_load: requests then
queue outside the loop, in sockets and frontend workers, where no count of rows sees them). Below that no fuller
batch can form, and small batches side by side are what the device can do best; a lone caller finds nothing out
and leaves at once.

Blocking callers (the direct engine's threads, ``submit_blocking``) share one queue without a loop: each caller
launches from its own thread what the rules above allow, then waits on a lock of its own; the waiter thread collects
their batches, answers them and launches what waits. No call crosses to an event loop and back.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol

from kiln.batching.admission import Admission
from kiln.batching.loop_load import LoopLoad
from kiln.batching.model import BatchModel, ExecutionTimes, arrivals, joined_counts
from kiln.batching.policy import BatchingPolicy
from kiln.engines.base import LaunchedBatch
from kiln.errors import InternalError, InvalidArgumentError, KilnError, VersionUnloadingError
from kiln.v2.types import InferRequest, InferResponse

PARAMETER = "launch_execution"
OVERLAP_PARAMETER = "launch_overlap_rows"
RETRY_S = 0.0005  # how soon requests retry when another caller (a blocking one, a draining scheduler) holds every lane
# Batches each instance may have launched and not yet collected. Requests that arrive meanwhile wait and leave as
# one batch when the instance's batch is back, as behind a busy Triton instance; launching each one onto another
# lane instead would send batches of one when requests arrive spread over loop turns (from the network, say), and
# every further lane captures CUDA graphs on the event loop the first time it sees a batch size.
BATCHES_PER_INSTANCE = 1

log = logging.getLogger(__name__)


class _Answer(Protocol):
    """Where a request's answer goes: an asyncio future, or a blocking caller's _Slot."""

    def done(self) -> bool: ...
    def set_result(self, result: InferResponse, /) -> None: ...
    def set_exception(self, exception: BaseException, /) -> None: ...


class _Slot:
    """A blocking caller's answer: the caller blocks on a lock the answering thread releases, cheaper than a
    concurrent.futures.Future with its condition. Answered once (the request sits in one queue or one batch)."""

    __slots__ = ("_ready", "_response", "_error")

    def __init__(self) -> None:
        self._ready = threading.Lock()
        self._ready.acquire()
        self._response: InferResponse | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._response is not None or self._error is not None

    def set_result(self, result: InferResponse, /) -> None:
        self._response = result
        self._ready.release()

    def set_exception(self, exception: BaseException, /) -> None:
        self._error = exception
        self._ready.release()

    def result(self) -> InferResponse:
        self._ready.acquire()
        if self._error is not None:
            raise self._error
        assert self._response is not None
        return self._response


@dataclass
class _Item:
    request: InferRequest
    rows: int
    enqueued_ns: int
    future: _Answer
    signature: Hashable


@dataclass(eq=False)  # compared by identity: the lists of batches out are searched for one of them
class _Flight:
    """A launched batch on its way through the waiter thread and back to its loop."""

    loop: asyncio.AbstractEventLoop | None  # None: blocking callers', collected on the waiter thread
    items: list[_Item]
    launched: LaunchedBatch
    instance: int  # the index of the engine it runs on
    start_ns: int
    infer_start_ns: int
    failure: BaseException | None = None
    posted: bool = False  # the waiter handed it to its loop, which alone collects it from then on


@dataclass
class _LoopQueue:
    items: list[_Item] = field(default_factory=list)
    scheduled: bool = False
    # Made on the loop's thread, whose CPU time it reads; None for the blocking callers, who all wait in the queue
    # or in a batch out, where the rows are counted.
    load: LoopLoad | None = field(default_factory=LoopLoad)


def launch_mode(model: BatchModel, policy: BatchingPolicy) -> str:
    mode = model.spec.parameters.get(PARAMETER, "auto") or "auto"
    if mode not in ("auto", "off"):
        raise InvalidArgumentError(f"model '{model.name}': parameter '{PARAMETER}' is '{mode}'; expected auto or "
                                   f"off")
    needs_queue = (policy.max_queue_delay_ns > 0 or policy.priority_levels > 1 or policy.preserve_ordering
                   or any(q.timeout_us or q.max_queue_size for q in policy.queue_policies.values()))
    able = bool(model.engines) and all(engine.launches for engine in model.engines)
    return "auto" if mode == "auto" and able and not needs_queue else "off"


def overlap_rows(model: BatchModel, policy: BatchingPolicy) -> int:
    """Rows a batch needs to start while another batch of the model is out (``launch_overlap_rows``)."""
    value = model.spec.parameters.get(OVERLAP_PARAMETER, "")
    if not value:
        if policy.preferred_batch_sizes:
            return policy.preferred_batch_sizes[0]
        return max(1, policy.max_batch_size // 8)
    if not value.isdigit() or int(value) < 1:
        raise InvalidArgumentError(f"model '{model.name}': parameter '{OVERLAP_PARAMETER}' is '{value}'; expected a "
                                   f"whole number of rows, 1 or more (1 starts every batch at once)")
    return int(value)


class LaunchRunner:
    def __init__(self, model: BatchModel, policy: BatchingPolicy,
                 signature: Callable[[InferRequest], Hashable]) -> None:
        self.model = model
        self.policy = policy
        self.active = launch_mode(model, policy) == "auto"
        self.overlap_rows = overlap_rows(model, policy)
        self._signature = signature
        self._queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopQueue] = weakref.WeakKeyDictionary()
        self._admission = Admission(model.name, model.version)
        self._queues_lock = threading.Lock()  # loops add themselves while other threads walk the queues
        # The same queues as a tuple that every batch's end walks without the lock; replaced whole when a loop comes
        # or goes.
        self._queue_list: tuple[tuple[weakref.ref[asyncio.AbstractEventLoop], _LoopQueue], ...] = ()
        # Under _out_lock: each instance's batches launched and not yet collected, and its launches under way.
        self._out_per_instance: list[list[_Flight]] = [[] for _ in model.engines]
        self._launching = [0] * len(model.engines)
        self._out_lock = threading.Lock()
        self._stopped = False
        self._engine_turn = itertools.count()
        self._flights: queue.SimpleQueue[_Flight | None] = queue.SimpleQueue()
        # Blocking callers' requests: appended to the inbox by any thread, moved into the queue and launched by
        # whichever thread holds the lock (a caller, the waiter, a retry timer); one that finds it held leaves the
        # mark instead, which the holder honours before it lets go, so nobody waits for the lock.
        self._blocking = _LoopQueue(load=None)
        self._blocking_inbox: collections.deque[_Item] = collections.deque()
        self._blocking_lock = threading.Lock()
        self._blocking_marked = False
        self._waiter: threading.Thread | None = None
        if self.active:
            self._waiter = threading.Thread(target=self._wait_for_device, daemon=True,
                                            name=f"kiln-{model.name}-{model.version}-launched")
            self._waiter.start()

    @property
    def inflight(self) -> int:
        return self._admission.inflight

    async def submit(self, request: InferRequest, rows: int) -> InferResponse:
        with self._admission:
            loop = asyncio.get_running_loop()
            future: asyncio.Future[InferResponse] = loop.create_future()
            pending = self._queues.get(loop)
            if pending is None:
                pending = self._add_loop(loop)
            pending.items.append(_Item(request, rows, time.monotonic_ns(), future, self._signature(request)))
            if not pending.scheduled:
                pending.scheduled = True
                loop.call_soon(self._flush, loop)
            return await future

    def submit_blocking(self, request: InferRequest, rows: int) -> InferResponse:
        """The blocking counterpart of ``submit``, for a caller on any thread."""
        with self._admission:
            slot = _Slot()
            item = _Item(request, rows, time.monotonic_ns(), slot, self._signature(request))
            self._blocking_inbox.append(item)
            self._flush_blocking()
            return slot.result()

    def close(self, timeout_s: float = 60.0) -> None:
        """Refuse new requests; wait (from another thread) until the admitted ones are answered and every launched
        batch is collected, so the engines can be closed; stop the waiter."""
        deadline = self._admission.close(timeout_s, busy=lambda: self._batches_out() > 0)
        self._stopped = True  # anything still waiting now is answered with an error, never launched
        for loop, _pending in self._waiting_loops():  # after a timeout, requests may still wait: answer them
            with contextlib.suppress(RuntimeError):  # a closed loop's requests are gone with it
                loop.call_soon_threadsafe(self._flush, loop)
        self._flush_blocking()
        if self._waiter is not None:
            self._flights.put(None)
            self._waiter.join(timeout=max(0.0, deadline - time.monotonic()))

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """Launch batches from this loop's waiting requests while an instance has no batch out and a free lane."""
        pending = self._queues.get(loop)
        if pending is None:
            return
        pending.scheduled = False
        self._launch_waiting(pending, loop)

    def _flush_blocking(self) -> None:
        self._blocking_marked = True
        while self._blocking_marked and self._blocking_lock.acquire(blocking=False):
            try:
                self._blocking_marked = False
                while self._blocking_inbox:
                    self._blocking.items.append(self._blocking_inbox.popleft())
                self._launch_waiting(self._blocking, None)
            finally:
                self._blocking_lock.release()

    def _launch_waiting(self, pending: _LoopQueue, loop: asyncio.AbstractEventLoop | None) -> None:
        """Launch batches from ``pending`` (on ``loop``'s thread; None: the blocking queue, under its lock)."""
        items = self._live(pending.items)
        if self._stopped:
            pending.items = []
            self._fail(items, VersionUnloadingError(f"model '{self.model.name}' version {self.model.version} "
                                                    f"is unloading"))
            return
        while items:
            batch = self._take_batch(items)
            if self._company_coming(batch, items, pending.load):
                items[:0] = batch  # the batch out comes back and wakes them (_finish), with more rows by then
                break
            if not self._launch(loop, batch):
                items[:0] = batch  # every lane is busy: these go first once a lane comes free
                if not self._batches_out():  # none of ours will come back to wake them: someone else holds the lanes
                    self._retry_later(pending, loop)
                break
        pending.items = items

    def _retry_later(self, pending: _LoopQueue, loop: asyncio.AbstractEventLoop | None) -> None:
        if loop is None:  # rare (callers beside the launches hold every lane): a timer thread, not a wait per call
            timer = threading.Timer(RETRY_S, self._flush_blocking)
            timer.daemon = True
            timer.start()
        else:
            pending.scheduled = True
            loop.call_later(RETRY_S, self._flush, loop)

    def _company_coming(self, batch: list[_Item], rest: list[_Item], load: LoopLoad | None) -> bool:
        """A batch too small to start beside the batches out (``overlap_rows``) while a fuller one can form: the
        rows out and waiting reach ``overlap_rows``, or the loop's thread is busy (requests then wait outside the
        loop, where no count sees them). Only batches whose loop can still collect them count, so one whose loop
        closed cannot hold requests back for good."""
        rows = sum(item.rows for item in batch)
        if self.overlap_rows <= 1 or rows >= self.overlap_rows:
            return False
        out = [flight for flights in self._out_per_instance for flight in flights
               if flight.loop is None or not flight.loop.is_closed()]
        if not out:
            return False
        if load is not None and load.busy():
            return True
        rows += sum(item.rows for item in rest) + sum(item.rows for flight in out for item in flight.items)
        return rows >= self.overlap_rows

    def _live(self, items: list[_Item]) -> list[_Item]:
        """The waiting requests whose callers still wait (the others count as CANCELED, as on the worker path)."""
        live = [item for item in items if not item.future.done()]
        if len(live) < len(items):
            now = time.monotonic_ns()
            for item in items:
                if item.future.done():
                    self.model.stats.record_failure(now - item.enqueued_ns, "CANCELED", item.request.members)
        return live

    def _take_batch(self, items: list[_Item]) -> list[_Item]:
        """The next batch: requests in arrival order with the first one's shapes, up to max_batch_size rows, cut
        at the largest preferred batch size it reaches."""
        first = items[0]
        rows, end, cut = first.rows, 1, 0
        preferred = self.policy.preferred_batch_sizes
        if rows in preferred:
            cut = end
        while end < len(items) and items[end].signature == first.signature \
                and rows + items[end].rows <= self.policy.max_batch_size:
            rows += items[end].rows
            end += 1
            if rows in preferred:
                cut = end
        taken = cut or end
        batch = items[:taken]
        del items[:taken]
        return batch

    def _launch(self, loop: asyncio.AbstractEventLoop | None, batch: list[_Item]) -> bool:
        start = time.monotonic_ns()
        requests = [item.request for item in batch]
        engines = self.model.engines
        first = next(self._engine_turn)
        for turn in range(len(engines)):  # round robin, so every instance takes turns
            instance = (first + turn) % len(engines)
            if not self._reserve(instance):
                continue
            try:
                launched = self.model.launch_batch(engines[instance], requests)
            except BaseException as exc:  # the batch's requests get the error; the loop carries on
                self._settle(instance, None)
                self._fail(batch, exc)
                return True
            if launched is None:  # other callers hold its lanes
                self._settle(instance, None)
                continue
            flight = _Flight(loop, batch, launched, instance, start, time.monotonic_ns())
            self._settle(instance, flight)
            self._flights.put(flight)
            return True
        return False

    def _reserve(self, instance: int) -> bool:
        """Claim a launch on ``instance`` unless it has its batches out. Loops on other threads launch too, so the
        check and the claim are one step. A batch whose loop closed before it could collect it is collected here:
        nobody else will, and it would hold the instance for good."""
        with self._out_lock:
            flights = self._out_per_instance[instance]
            orphans = [flight for flight in flights
                       if flight.posted and flight.loop is not None and flight.loop.is_closed()]
            for orphan in orphans:
                flights.remove(orphan)
            claimed = len(flights) + self._launching[instance] < BATCHES_PER_INSTANCE
            if claimed:
                self._launching[instance] += 1
        for orphan in orphans:
            self._collect_orphan(orphan)
        return claimed

    def _settle(self, instance: int, flight: _Flight | None) -> None:
        """End a claim: the batch is out (``flight``), or the launch did not happen."""
        with self._out_lock:
            self._launching[instance] -= 1
            if flight is not None:
                self._out_per_instance[instance].append(flight)

    def _release(self, flight: _Flight) -> None:
        """The batch was collected (or abandoned): its instance may launch again."""
        with self._out_lock:
            flights = self._out_per_instance[flight.instance]
            if flight in flights:
                flights.remove(flight)

    def _batches_out(self) -> int:
        """Batches launched and not yet collected, over all instances (a snapshot; a few lists to count)."""
        return sum(len(flights) for flights in self._out_per_instance)

    def _wait_for_device(self) -> None:
        while True:
            flight = self._flights.get()
            if flight is None:
                return
            self._post_when_done(flight)
            # Hold nothing of the batch while waiting for the next one: its requests' inputs may be views that
            # pin a client's body or a worker's shared-memory slot.
            del flight

    def _post_when_done(self, flight: _Flight) -> None:
        try:
            flight.launched.wait()
        except BaseException as exc:  # collect() still runs on the loop, to give the lane back
            flight.failure = exc
        if flight.loop is None:  # blocking callers: answered from here
            try:
                self._finish(flight)
            except Exception:  # the waiter must live on: later batches need it
                log.exception("model '%s': answering a batch of blocking callers failed", self.model.name)
            return
        try:
            flight.loop.call_soon_threadsafe(self._finish, flight)
            flight.posted = True
        except RuntimeError:  # the loop is closed: nobody waits for these answers; free the lane here
            self._release(flight)
            self._collect_orphan(flight)
            self._flush_waiting(None)  # requests on other loops may wait for this instance

    def _collect_orphan(self, flight: _Flight) -> None:
        """Give back the lane of a batch whose event loop closed; its callers are gone."""
        try:
            flight.launched.collect()
        except BaseException:  # the waiter must live on: later batches need it
            log.exception("model '%s': collecting a batch whose event loop has closed failed", self.model.name)
        now = time.monotonic_ns()
        for item in flight.items:
            self.model.stats.record_failure(now - item.enqueued_ns, "CANCELED", item.request.members)

    def _finish(self, flight: _Flight) -> None:
        items = flight.items
        try:
            try:
                results = flight.launched.collect()
            finally:
                self._release(flight)
            if flight.failure is not None:
                raise flight.failure
            infer_end = time.monotonic_ns()
            responses = self.model.responses([item.request for item in items], [item.rows for item in items],
                                             results)
        except BaseException as exc:
            self._fail(items, exc)
        else:
            end = time.monotonic_ns()
            for item, response in zip(items, responses, strict=True):
                if not item.future.done():
                    item.future.set_result(response)
            times = ExecutionTimes(sum(item.rows for item in items), flight.start_ns,
                                   flight.infer_start_ns - flight.start_ns, infer_end - flight.infer_start_ns,
                                   end - infer_end)
            try:
                self.model.stats.record_success(times, arrivals((item.enqueued_ns, item.request) for item in items),
                                                end, joined_counts(item.request for item in items))
            except Exception:  # a request observer's failure must not stop the next batches
                log.exception("model '%s': recording a launched batch's statistics failed", self.model.name)
        self._flush_waiting(flight.loop)

    def _flush_waiting(self, here: asyncio.AbstractEventLoop | None) -> None:
        """An instance came free: launch what waits on this loop now (``here``; None from the waiter thread) and
        what blocking callers queued, and wake other loops that have requests waiting."""
        if self._blocking.items or self._blocking_inbox:
            self._flush_blocking()
        for loop, pending in self._waiting_loops():
            if pending.scheduled:
                continue
            pending.scheduled = True
            if loop is here:
                self._flush(loop)
            else:
                try:
                    loop.call_soon_threadsafe(self._flush, loop)
                except RuntimeError:  # a closed loop's requests are gone with it
                    with self._queues_lock:
                        self._queues.pop(loop, None)
                        self._list_queues()

    def _add_loop(self, loop: asyncio.AbstractEventLoop) -> _LoopQueue:
        with self._queues_lock:
            pending = self._queues[loop] = _LoopQueue()
            self._list_queues()
        return pending

    def _list_queues(self) -> None:
        """Under ``_queues_lock``: the tuple of the loops' queues, without loops that are gone."""
        self._queue_list = tuple((weakref.ref(loop), pending) for loop, pending in self._queues.items())

    def _waiting_loops(self) -> list[tuple[asyncio.AbstractEventLoop, _LoopQueue]]:
        waiting = []
        for ref, pending in self._queue_list:
            if pending.items:
                loop = ref()
                if loop is not None:
                    waiting.append((loop, pending))
        return waiting

    def _fail(self, items: list[_Item], exc: BaseException) -> None:
        error = exc if isinstance(exc, KilnError) else InternalError(f"model '{self.model.name}': {exc}")
        now = time.monotonic_ns()
        for item in items:
            self.model.stats.record_failure(now - item.enqueued_ns, requests=item.request.members)
            if not item.future.done():
                item.future.set_exception(error)
