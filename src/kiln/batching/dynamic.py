"""The dynamic batcher: one queue per model version, one worker thread per instance.

A worker takes the next batch the queue's rule allows (see queue.py), runs it on its engine, and answers every
request in it: exactly one response or error each. With preserve_ordering, answers are released in arrival order
even when instances finish out of order.

Answers to callers on an event loop go back in one hand-off per batch and loop (answers.py). Engines that queue
batches on a device take requests from the event loop instead (launched.py); the workers then serve only blocking
callers.

With ``caller_runs`` (the direct engine: one instance), a blocking caller that finds the instance idle and nobody
queued runs its request on its own thread, sparing a lone caller the two thread hops; callers that arrive meanwhile
queue for the worker, which waits until the instance is free.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from kiln.batching.answers import Answer, deliver
from kiln.batching.inline import InlineRunner
from kiln.batching.launched import LaunchRunner
from kiln.batching.model import BatchModel, arrivals, joined_counts
from kiln.batching.policy import BatchingPolicy
from kiln.batching.queue import Batch, BatchQueue, Pending, batch_signature
from kiln.engines.base import Engine
from kiln.errors import (
    CancelledError,
    InternalError,
    KilnError,
    QueueFullError,
    RequestTimeoutError,
    VersionUnloadingError,
)
from kiln.v2.types import InferRequest, InferResponse

Clock = Callable[[], int]


class DynamicBatcher:
    def __init__(self, model: BatchModel, policy: BatchingPolicy, clock: Clock = time.monotonic_ns,
                 caller_runs: bool = False) -> None:
        self.model = model
        self.policy = policy
        self._clock = clock
        self._queue = BatchQueue(model.name, policy)
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._inflight = 0
        self._closed = False
        self._release = _OrderedRelease() if policy.preserve_ordering else None
        self._launcher = LaunchRunner(model, policy, batch_signature)
        self._inline = InlineRunner(model, policy.max_batch_size, batch_signature)
        if not _simple(policy) or self._launcher.active:
            self._inline.mode = "off"  # delays, priorities and queue policies need the real queue
        self._busy = 0  # batches being executed (by the workers, or by callers with caller_runs)
        self._caller_runs = caller_runs and len(model.engines) == 1 and not policy.preserve_ordering
        self._workers = [threading.Thread(target=self._work, args=(engine,), daemon=True,
                                          name=f"kiln-{model.name}-{model.version}-{index}")
                         for index, engine in enumerate(model.engines)]
        for worker in self._workers:
            worker.start()

    @property
    def inflight(self) -> int:
        return self._inflight + self._inline.inflight + self._launcher.inflight

    @property
    def launches(self) -> bool:
        """True when requests from an event loop are launched onto the engines (launched.py), not run by workers."""
        return self._launcher.active

    async def submit(self, request: InferRequest, batch_size: int) -> InferResponse:
        launched = self._launcher.active
        if launched or (self._inline.wanted() and not self._busy and not len(self._queue)):
            self._check_parameters(request)
            runner = self._launcher if launched else self._inline
            return await runner.submit(request, batch_size)
        waiter: asyncio.Future[InferResponse] = asyncio.get_running_loop().create_future()
        self._enqueue(request, batch_size, waiter)
        return await waiter

    def submit_launched_sync(self, request: InferRequest, batch_size: int) -> InferResponse:
        """A blocking caller's request launched as event loops' are (where ``launches``; else ``submit_sync``):
        the direct engine's threads share batches without a worker or a loop in between."""
        if not self._launcher.active:
            return self.submit_sync(request, batch_size)
        self._check_parameters(request)
        return self._launcher.submit_blocking(request, batch_size)

    def _check_parameters(self, request: InferRequest) -> None:
        """Runners without the queue still reject the bad parameters the queue would."""
        if request.parameters:
            self.policy.priority_of(self.model.name, request)

    def submit_sync(self, request: InferRequest, batch_size: int) -> InferResponse:
        if self._caller_runs:
            outcome = self._run_here(request, batch_size)
            if isinstance(outcome, BaseException):
                raise outcome
            if outcome is not None:
                return outcome
        answer: Future[InferResponse] = Future()
        self._enqueue(request, batch_size, answer)
        return answer.result()

    def _run_here(self, request: InferRequest, batch_size: int) -> InferResponse | BaseException | None:
        """Run the request on the calling thread if the instance is idle, nothing is queued and the last batch
        was a lone one (after a batch with company, the queue gathers the returning callers instead); None when
        it must queue."""
        priority = self.policy.priority_of(self.model.name, request)  # rejects bad parameters as the queue would
        with self._cond:
            if self._busy or len(self._queue) or self._closed or self._queue.last_rows > 1:
                return None
            self._busy += 1
            self._inflight += 1
        pending = Pending(request=request, rows=batch_size, signature=None, priority=priority,
                          enqueued_ns=self._clock(), deadline_ns=0, seq=0)
        try:
            ((_, outcome),) = self._execute(self.model.engines[0], [pending])
        finally:
            with self._cond:
                self._busy -= 1
                self._inflight -= 1
                if len(self._queue) or self._closed:  # the worker waits for the instance to be free
                    self._cond.notify_all()
        return outcome

    def close(self) -> None:
        """Stop taking requests, run the queued ones, then release the engines."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for worker in self._workers:
            worker.join()
        self._inline.close()  # requests admitted to run inline on the event loop finish too
        self._launcher.close()  # ...and those launched from it
        self.model.close()

    def _enqueue(self, request: InferRequest, batch_size: int,
                 answer: Answer) -> None:
        name = self.model.name
        priority = self.policy.priority_of(name, request)
        timeout_us = self.policy.timeout_us_of(name, request, priority)
        now = self._clock()
        pending = Pending(request=request, rows=batch_size, signature=batch_signature(request), priority=priority,
                          enqueued_ns=now, deadline_ns=now + timeout_us * 1000 if timeout_us else 0,
                          seq=next(self._seq), answer=answer)
        with self._cond:
            if self._closed:
                raise VersionUnloadingError(f"model '{name}' version {self.model.version} is unloading")
            try:
                self._queue.put(pending)
            except QueueFullError:
                self.model.stats.record_failure(0, "REJECTED", request.members)
                raise
            self._inflight += 1
            if self._release is not None:
                self._release.expect(pending.seq)
            self._cond.notify()

    def _work(self, engine: Engine) -> None:
        while True:
            batch = self._next_batch()  # counts this worker busy
            if batch is None:
                return
            self._run(engine, batch)
            # Hold nothing of the batch while waiting for the next one: its requests' inputs may be views that
            # pin a client's body or a worker's shared-memory slot.
            del batch

    def _run(self, engine: Engine, batch: Batch) -> None:
        outcomes: list[tuple[Pending, InferResponse | BaseException]] = []
        try:
            early: list[tuple[Pending, InferResponse | BaseException]] = []  # answered before the batch runs
            for pending in batch.expired:
                waited_ns = self._clock() - pending.enqueued_ns
                self.model.stats.record_failure(waited_ns, "REJECTED", pending.request.members)
                early.append((pending, RequestTimeoutError(f"model '{self.model.name}': request timed out "
                                                           f"after waiting in the queue {waited_ns // 1000} us")))
            live = self._drop_cancelled(batch.items, early)
            self._answer(early)
            if live:
                outcomes = self._execute(engine, live)
        finally:
            with self._cond:
                self._busy -= 1
        # Answer once the worker counts as idle, so the next request may already run inline.
        self._answer(outcomes)

    def _drop_cancelled(self, items: list[Pending],
                        answers: list[tuple[Pending, InferResponse | BaseException]]) -> list[Pending]:
        """Requests whose client went away before they ran are not run (counted as CANCELED)."""
        live = [p for p in items if not p.answer.cancelled()]
        for pending in items:
            if pending.answer.cancelled():
                self.model.stats.record_failure(self._clock() - pending.enqueued_ns, "CANCELED",
                                                pending.request.members)
                answers.append((pending, CancelledError(f"model '{self.model.name}': the request was cancelled")))
        return live

    def _next_batch(self) -> Batch | None:
        """The next batch to run, counted busy in the same step (a caller that may run its own request must see
        the instance taken); None once closed and drained."""
        with self._cond:
            while True:
                timeout = None
                if not (self._caller_runs and self._busy):  # with caller_runs, wait while a caller has the instance
                    batch = self._queue.next_batch(self._clock())
                    if batch.items or batch.expired:
                        self._busy += 1
                        return batch
                    if batch.wake_at_ns is not None:
                        timeout = max(0, batch.wake_at_ns - self._clock()) / 1e9
                if self._closed and not len(self._queue) and not (self._caller_runs and self._busy):
                    return None
                self._cond.wait(timeout)

    def _execute(self, engine: Engine,
                 items: list[Pending]) -> list[tuple[Pending, InferResponse | BaseException]]:
        try:
            responses, times = self.model.run_batch(engine, [p.request for p in items], [p.rows for p in items])
        except BaseException as exc:  # every request of a failed batch gets the error; the worker lives on
            error = exc if isinstance(exc, KilnError) else InternalError(f"model '{self.model.name}': {exc}")
            end = self._clock()
            for pending in items:
                self.model.stats.record_failure(end - pending.enqueued_ns, requests=pending.request.members)
            return [(pending, error) for pending in items]
        self._inline.observe(times)
        self.model.stats.record_success(times, arrivals((p.enqueued_ns, p.request) for p in items), self._clock(),
                                        joined_counts(p.request for p in items))
        return list(zip(items, responses, strict=True))

    def _answer(self, answers: list[tuple[Pending, InferResponse | BaseException]]) -> None:
        if not answers:
            return
        with self._cond:
            self._inflight -= len(answers)
        if self._release is not None:
            answers = self._release.done(answers)
        deliver((pending.answer, outcome) for pending, outcome in answers)


def _simple(policy: BatchingPolicy) -> bool:
    queues = policy.queue_policies.values()
    return (policy.max_queue_delay_ns == 0 and policy.priority_levels <= 1 and not policy.preferred_batch_sizes
            and all(q.timeout_us == 0 and q.max_queue_size == 0 for q in queues))


class _OrderedRelease:
    """Hands answers out in arrival order (preserve_ordering)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._expected: collections.deque[int] = collections.deque()
        self._ready: dict[int, tuple[Pending, InferResponse | BaseException]] = {}

    def expect(self, seq: int) -> None:
        with self._lock:
            self._expected.append(seq)

    def done(self, answers: list[tuple[Pending, InferResponse | BaseException]],
             ) -> list[tuple[Pending, InferResponse | BaseException]]:
        """Record ``answers``; return every answer that may be released now, in arrival order."""
        with self._lock:
            for pending, outcome in answers:
                self._ready[pending.seq] = (pending, outcome)
            releasable: list[tuple[Pending, InferResponse | BaseException]] = []
            while self._expected and self._expected[0] in self._ready:
                releasable.append(self._ready.pop(self._expected.popleft()))
        return releasable
