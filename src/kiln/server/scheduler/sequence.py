"""The sequence batcher for stateful models (Triton's ``sequence_batching``).

A sequence is the run of requests that share a ``sequence_id``, from the one marked ``sequence_start`` to the one
marked ``sequence_end``. It is bound to one slot of one instance for its whole life, so the model (or the implicit
state kept here) sees its requests in arrival order, one at a time, on one instance. A new sequence waits in a
backlog while every slot is taken; a slot is freed when its sequence's END request has run, or when the sequence
sits idle for ``max_sequence_idle_microseconds`` (later requests for it then fail).

Batches (formed by :class:`SequenceTable`, free of threads so a fake clock can drive it):

- **direct**: an instance has ``max_batch_size`` slots. A batch holds one row per slot, from slot 0 up to the highest
  slot whose request joins it; the slots in between get a zero-filled padding row with READY false.
- **oldest**: an instance holds ``max_candidate_sequences`` sequences and batches those with a request waiting,
  in the order their requests became runnable, at most one per sequence, like the dynamic batcher. Each batch is a
  prefix of that order and an instance runs one batch at a time, so answers leave an instance in order: the
  ``preserve_ordering`` guarantee holds whether or not it is set.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.batching.answers import Answer, deliver
from kiln.batching.queue import batch_signature
from kiln.config.autocomplete import SEQUENCE_IDLE_DEFAULT_US
from kiln.engines.base import Engine
from kiln.errors import InternalError, InvalidArgumentError, KilnError, UnsupportedError, VersionUnloadingError
from kiln.server.model import LoadedModel
from kiln.server.scheduler.sequence_controls import (
    PADDING,
    RowControl,
    SequenceControls,
    SequenceId,
    SequenceParams,
    sequence_params,
)
from kiln.server.scheduler.sequence_state import (
    StateRow,
    StateSpec,
    initial_row,
    load_states,
    split_states,
    stack_states,
)
from kiln.v2._generated import model_config_pb2 as pb
from kiln.v2.types import InferRequest, InferResponse, InputTensor, RequestedOutput

log = logging.getLogger("kiln.server")

Array = npt.NDArray[Any]
Clock = Callable[[], int]
Slot = tuple[int, int]  # (instance, slot index)

@dataclass(frozen=True)
class SequencePolicy:
    """``sequence_batching`` as the batcher uses it."""

    oldest: bool
    slots_per_instance: int
    max_rows: int  # rows per execution: max_batch_size, at least 1
    idle_ns: int
    max_queue_delay_ns: int = 0
    minimum_slot_utilization: float = 0.0  # direct only
    preferred_batch_sizes: tuple[int, ...] = ()  # oldest only

    @classmethod
    def from_config(cls, config: pb.ModelConfig) -> SequencePolicy:
        batching = config.sequence_batching
        rows = max(1, config.max_batch_size)
        idle_ns = (batching.max_sequence_idle_microseconds or SEQUENCE_IDLE_DEFAULT_US) * 1000
        if batching.WhichOneof("strategy_choice") == "oldest":
            oldest = batching.oldest
            return cls(oldest=True, slots_per_instance=oldest.max_candidate_sequences or rows, max_rows=rows,
                       idle_ns=idle_ns, max_queue_delay_ns=oldest.max_queue_delay_microseconds * 1000,
                       preferred_batch_sizes=tuple(sorted(set(oldest.preferred_batch_size))))
        direct = batching.direct
        return cls(oldest=False, slots_per_instance=rows, max_rows=rows, idle_ns=idle_ns,
                   max_queue_delay_ns=direct.max_queue_delay_microseconds * 1000,
                   minimum_slot_utilization=direct.minimum_slot_utilization)


@dataclass(eq=False)
class Pending:
    """An admitted request and where its answer goes."""

    request: InferRequest
    params: SequenceParams
    signature: Hashable  # rows batch together only with equal signatures
    enqueued_ns: int
    answer: Answer = field(default_factory=Future)  # an asyncio future for a caller on an event loop


@dataclass(eq=False)
class SequenceEntry:
    """One sequence: its waiting requests, its slot (None while in the backlog) and its implicit state."""

    sequence_id: SequenceId
    last_ns: int  # last arrival or completion; idle time counts from here
    queue: collections.deque[Pending] = field(default_factory=collections.deque)
    slot: Slot | None = None
    busy: bool = False  # one of its requests is executing
    runnable_ns: int | None = None  # when the front request could first run
    runnable_order: int = 0
    state: StateRow | None = None


@dataclass(frozen=True)
class Row:
    """One row of a batch: a sequence's request, or padding (``pending`` None) that keeps later slots in place."""

    slot: int
    entry: SequenceEntry | None = None
    pending: Pending | None = None
    state: StateRow | None = None

    @property
    def control(self) -> RowControl:
        if self.pending is None:
            return PADDING
        params = self.pending.params
        return RowControl(ready=True, start=params.start, end=params.end, sequence_id=params.sequence_id)


@dataclass
class Round:
    instance: int
    rows: list[Row]
    wake_at_ns: int | None = None  # when to look again if no rows were formed; None = on the next event


class SequenceTable:
    """Sequences, slots, the backlog and batch formation. Not thread-safe: the batcher holds its lock."""

    def __init__(self, model: str, policy: SequencePolicy, instances: int, states: Sequence[StateSpec] = ()) -> None:
        self.model = model
        self.policy = policy
        self._states = tuple(states)
        self._active: dict[SequenceId, SequenceEntry] = {}  # ids whose END has not arrived
        self._slots: list[list[SequenceEntry | None]] = [[None] * policy.slots_per_instance
                                                         for _ in range(instances)]
        self._backlog: collections.deque[SequenceEntry] = collections.deque()
        self._order = itertools.count()
        self._queued = 0
        self._busy = 0

    @property
    def drained(self) -> bool:
        """No request is waiting or executing."""
        return self._queued == 0 and self._busy == 0

    def slot_of(self, sequence_id: SequenceId) -> Slot | None:
        entry = self._active.get(sequence_id)
        return entry.slot if entry is not None else None

    def backlog(self) -> list[SequenceId]:
        return [entry.sequence_id for entry in self._backlog]

    def admit(self, pending: Pending, now_ns: int) -> None:
        params = pending.params
        entry = self._active.get(params.sequence_id)
        if entry is None:
            if not params.start:
                raise self._not_active(params.sequence_id)
            entry = SequenceEntry(params.sequence_id, now_ns)
            self._active[params.sequence_id] = entry
            self._place(entry)
        elif params.start:
            # Triton: the earlier sequence did not end; its queued requests still run, then this one starts.
            log.warning("sequence %r for model '%s' has a conflict: the previous sequence did not end before this "
                        "sequence start; the previous sequence is terminated early", params.sequence_id, self.model)
        entry.queue.append(pending)
        entry.last_ns = now_ns
        self._queued += 1
        if params.end:
            del self._active[params.sequence_id]  # the id may start a new sequence at once
        self._mark_runnable(entry, now_ns)

    def next_round(self, instance: int, now_ns: int) -> Round:
        if self.policy.oldest:
            return self._oldest_round(instance, now_ns)
        return self._direct_round(instance, now_ns)

    def complete(self, batch: Round, states: Sequence[StateRow | None] | None, now_ns: int) -> None:
        """Book a finished batch. ``states`` (aligned with the rows) are the sequences' next implicit states;
        None when the execution failed, which keeps the previous ones."""
        for index, row in enumerate(batch.rows):
            entry, pending = row.entry, row.pending
            if entry is None or pending is None:
                continue
            entry.busy = False
            entry.last_ns = now_ns
            self._busy -= 1
            if states is not None and states[index] is not None:
                entry.state = states[index]
            if pending.params.end:
                self._release(entry, now_ns)
            else:
                self._mark_runnable(entry, now_ns)

    def reap(self, now_ns: int, closing: bool = False) -> list[SequenceId]:
        """Release the slots of sequences idle for max_sequence_idle_microseconds (all idle ones when closing)."""
        expired = [sid for sid, entry in self._active.items() if self._idle(entry)
                   and (closing or now_ns - entry.last_ns >= self.policy.idle_ns)]
        for sid in expired:
            log.debug("model '%s': sequence %r released after %d us idle", self.model, sid,
                      (now_ns - self._active[sid].last_ns) // 1000)
            self._release(self._active.pop(sid), now_ns)
        return expired

    def next_idle_at(self) -> int | None:
        deadlines = [e.last_ns + self.policy.idle_ns for e in self._active.values() if self._idle(e)]
        return min(deadlines) if deadlines else None

    # -- slots -------------------------------------------------------------------------------------------------

    def _place(self, entry: SequenceEntry) -> None:
        """The free slot with the lowest index, spreading sequences over instances first (as Triton does)."""
        for index in range(self.policy.slots_per_instance):
            for instance, slots in enumerate(self._slots):
                if slots[index] is None:
                    self._assign(entry, instance, index)
                    return
        self._backlog.append(entry)

    def _assign(self, entry: SequenceEntry, instance: int, index: int) -> None:
        self._slots[instance][index] = entry
        entry.slot = (instance, index)

    def _release(self, entry: SequenceEntry, now_ns: int) -> None:
        if entry.slot is None:
            return
        instance, index = entry.slot
        entry.slot = None
        self._slots[instance][index] = None
        if self._backlog:
            waiting = self._backlog.popleft()
            self._assign(waiting, instance, index)
            self._mark_runnable(waiting, now_ns)

    @staticmethod
    def _idle(entry: SequenceEntry) -> bool:
        return not entry.queue and not entry.busy

    def _mark_runnable(self, entry: SequenceEntry, now_ns: int) -> None:
        if entry.slot is not None and entry.queue and not entry.busy and entry.runnable_ns is None:
            entry.runnable_ns = now_ns
            entry.runnable_order = next(self._order)

    def _not_active(self, sequence_id: SequenceId) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"inference request for sequence {sequence_id!r} to model '{self.model}' must specify the START flag on "
            f"the first request of the sequence: sequence {sequence_id!r} is not active (never started, already "
            f"ended, or released after max_sequence_idle_microseconds={self.policy.idle_ns // 1000} idle); set "
            f"request parameter 'sequence_start' to true to start it")

    # -- batches -----------------------------------------------------------------------------------------------

    def _ready(self, instance: int) -> list[tuple[int, SequenceEntry]]:
        return [(index, entry) for index, entry in enumerate(self._slots[instance])
                if entry is not None and entry.queue and not entry.busy]

    def _row_state(self, entry: SequenceEntry) -> StateRow | None:
        if not self._states:
            return None
        if entry.queue[0].params.start or entry.state is None:
            return initial_row(self._states)
        return entry.state

    def _signature(self, entry: SequenceEntry) -> Hashable:
        state = self._row_state(entry) or {}
        return entry.queue[0].signature, tuple(sorted((name, value.shape) for name, value in state.items()))

    def _take(self, index: int, entry: SequenceEntry) -> Row:
        state = self._row_state(entry)
        pending = entry.queue.popleft()
        entry.busy = True
        entry.runnable_ns = None
        self._queued -= 1
        self._busy += 1
        return Row(index, entry, pending, state)

    def _direct_round(self, instance: int, now_ns: int) -> Round:
        ready = dict(self._ready(instance))
        if not ready:
            return Round(instance, [])
        policy = self.policy
        if policy.max_queue_delay_ns and policy.minimum_slot_utilization > 0:
            # Triton: wait for more slots to fill, unless the oldest request has waited max_queue_delay.
            oldest = min(entry.queue[0].enqueued_ns for entry in ready.values())
            utilization = len(ready) / policy.slots_per_instance
            if now_ns - oldest < policy.max_queue_delay_ns and utilization < policy.minimum_slot_utilization:
                return Round(instance, [], oldest + policy.max_queue_delay_ns)
        # The oldest waiting request sets the batch's shapes, so a request with other shapes cannot starve.
        signature = self._signature(min(ready.values(), key=lambda entry: entry.queue[0].enqueued_ns))
        # A request whose shapes differ from the batch's waits for a later round; its slot is padded now.
        usable = {index: entry for index, entry in ready.items() if self._signature(entry) == signature}
        rows = [self._take(index, usable[index]) if index in usable else Row(index) for index in range(max(usable) + 1)]
        return Round(instance, rows)

    def _oldest_round(self, instance: int, now_ns: int) -> Round:
        ready = sorted(self._ready(instance), key=lambda item: item[1].runnable_order)
        if not ready:
            return Round(instance, [])
        signature = self._signature(ready[0][1])
        chosen: list[tuple[int, SequenceEntry]] = []
        blocked = False
        for index, entry in ready:
            if len(chosen) == self.policy.max_rows or self._signature(entry) != signature:
                blocked = True
                break
            chosen.append((index, entry))
        oldest = min(entry.runnable_ns or 0 for _, entry in chosen)
        count = self._oldest_count(len(chosen), blocked, now_ns - oldest)
        if count == 0:
            return Round(instance, [], oldest + self.policy.max_queue_delay_ns)
        return Round(instance, [self._take(index, entry) for index, entry in chosen[:count]])

    def _oldest_count(self, available: int, blocked: bool, waited_ns: int) -> int:
        """The dynamic batcher's rule: the largest preferred size that can be formed; else everything once the
        batch cannot grow or the oldest request has waited max_queue_delay; else nothing yet."""
        policy = self.policy
        fitting = [size for size in policy.preferred_batch_sizes if size <= available]
        if fitting:
            return max(fitting)
        if blocked or available >= policy.max_rows or waited_ns >= policy.max_queue_delay_ns:
            return available
        return 0


class SequenceBatcher:
    """Runs a model's sequences: one worker thread per instance, futures for the answers."""

    def __init__(self, model: LoadedModel, clock: Clock = time.monotonic_ns) -> None:
        config = model.spec.config
        if config.sequence_batching.iterative_sequence:
            raise UnsupportedError(f"model '{model.name}': sequence_batching.iterative_sequence is not supported by "
                                   f"this kiln version; remove it")
        self.model = model
        self.policy = SequencePolicy.from_config(config)
        self.controls = SequenceControls.from_config(config.sequence_batching)
        self.states = load_states(config, model.path)
        self._clock = clock
        self._table = SequenceTable(model.name, self.policy, len(model.engines), self.states)
        self._cond = threading.Condition()
        self._inflight = 0
        self._closed = False
        self._workers = [threading.Thread(target=self._work, args=(index, engine), daemon=True,
                                          name=f"kiln-{model.name}-{model.version}-seq{index}")
                         for index, engine in enumerate(model.engines)]
        for worker in self._workers:
            worker.start()

    @property
    def inflight(self) -> int:
        return self._inflight

    async def submit(self, request: InferRequest, batch_size: int) -> InferResponse:
        waiter: asyncio.Future[InferResponse] = asyncio.get_running_loop().create_future()
        self._enqueue(request, batch_size, waiter)
        return await waiter

    def submit_sync(self, request: InferRequest, batch_size: int) -> InferResponse:
        answer: Future[InferResponse] = Future()
        self._enqueue(request, batch_size, answer)
        return answer.result()

    def close(self) -> None:
        """Stop taking requests, run the queued ones (idle sequences give up their slots at once), then release
        the engines."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for worker in self._workers:
            worker.join()
        self.model.close()

    def _enqueue(self, request: InferRequest, batch_size: int, answer: Answer) -> None:
        name = self.model.name
        params = sequence_params(name, request)
        if batch_size != 1:
            raise InvalidArgumentError(f"inference request to model '{name}' must specify batch-size 1 due to "
                                       f"requirements of sequence batcher (got {batch_size}); send one row per "
                                       f"request")
        self.controls.check(name, params)
        pending = Pending(request, params, batch_signature(request), self._clock(), answer)
        with self._cond:
            if self._closed:
                raise VersionUnloadingError(f"model '{name}' version {self.model.version} is unloading")
            self._table.admit(pending, pending.enqueued_ns)
            self._inflight += 1
            self._cond.notify_all()

    def _work(self, instance: int, engine: Engine) -> None:
        while (batch := self._next_round(instance)) is not None:
            self._execute(engine, batch)

    def _next_round(self, instance: int) -> Round | None:
        with self._cond:
            while True:
                now = self._clock()
                if self._table.reap(now, closing=self._closed):
                    self._cond.notify_all()  # a freed slot may go to a backlogged sequence of another instance
                batch = self._table.next_round(instance, now)
                if batch.rows:
                    return batch
                if self._closed and self._table.drained:
                    return None
                wakes = [t for t in (batch.wake_at_ns, self._table.next_idle_at()) if t is not None]
                self._cond.wait(max(0, min(wakes) - now) / 1e9 if wakes else None)

    def _execute(self, engine: Engine, batch: Round) -> None:
        rows = batch.rows
        real = [row.pending for row in rows if row.pending is not None]
        batching = self.model.spec.batching
        extra = self.controls.tensors([row.control for row in rows], batching)
        if self.states:
            extra.update(stack_states(self.states, [row.state for row in rows], batching))
        feed = _ServerFilledInputs(engine, extra, [spec.output_name for spec in self.states])
        requests = [row.pending.request if row.pending is not None else _padding(real[0].request) for row in rows]
        try:
            responses, times = self.model.run_batch(feed, requests, [1] * len(requests))
            states = self._next_states(rows, feed.state_outputs)
        except BaseException as exc:  # every request of a failed batch gets the error; the worker lives on
            error = exc if isinstance(exc, KilnError) else InternalError(f"model '{self.model.name}': {exc}")
            self._finish(batch, None, len(real))
            end = self._clock()
            for pending in real:
                self.model.stats.record_failure(end - pending.enqueued_ns)
            deliver((pending.answer, error) for pending in real)
            return
        self._finish(batch, states, len(real))
        # Padding rows are not inferences: count the requests only.
        self.model.stats.record_success(dataclasses.replace(times, batch_size=len(real)),
                                        [p.enqueued_ns for p in real], self._clock())
        deliver((row.pending.answer, response) for row, response in zip(rows, responses, strict=True)
                if row.pending is not None)

    def _next_states(self, rows: Sequence[Row], outputs: Mapping[str, Array]) -> list[StateRow | None] | None:
        if not self.states:
            return None
        states = split_states(self.states, outputs, len(rows), self.model.spec.batching)
        return [state if row.pending is not None else None for row, state in zip(rows, states, strict=True)]

    def _finish(self, batch: Round, states: list[StateRow | None] | None, answered: int) -> None:
        with self._cond:
            self._table.complete(batch, states, self._clock())
            self._inflight -= answered
            self._cond.notify_all()


class _ServerFilledInputs(Engine):
    """Adds the control and state tensors to a batch's inputs and keeps the state outputs the engine returns."""

    def __init__(self, engine: Engine, extra: dict[str, Array], state_names: list[str]) -> None:
        super().__init__(engine.spec)
        self._engine = engine
        self._extra = extra
        self._state_names = state_names
        self.state_outputs: dict[str, Array] = {}

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        names = list(outputs) + [name for name in self._state_names if name not in outputs]
        results = self._engine.execute({**inputs, **self._extra}, names)
        self.state_outputs = {name: results[name] for name in self._state_names}
        return results


def _padding(template: InferRequest) -> InferRequest:
    """A request shaped like ``template`` with zero (or empty BYTES) inputs, for a slot without a request."""
    inputs = [InputTensor(t.name, t.datatype, t.shape, np.full(t.shape, b"", dtype=object)
                          if t.data.dtype == object else np.zeros(t.shape, dtype=t.data.dtype))
              for t in template.inputs]
    outputs = [RequestedOutput(o.name) for o in template.outputs]
    return InferRequest(template.model_name, inputs, template.model_version, outputs=outputs)
