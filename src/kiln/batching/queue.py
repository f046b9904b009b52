"""The dynamic batcher's queue and its batch-forming rule, kept free of threads so a fake clock can drive it.

Rule (Triton's): requests are taken by priority level, then arrival order. A batch grows while the next request
has the same input shapes (after the batch dimension) and still fits in max_batch_size. It is sent at once when
it is full, cannot grow, or reaches a preferred batch size (the largest one that can be formed); otherwise when
its oldest request has waited max_queue_delay (with delay_needs_company, only while fewer rows wait than the last
batch had: a lone caller runs at once). Requests whose timeout passes while queued are rejected (REJECT)
or moved behind every other request (DELAY).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from kiln.batching.answers import Answer
from kiln.batching.policy import BatchingPolicy
from kiln.errors import QueueFullError
from kiln.v2.types import InferRequest


def batch_signature(request: InferRequest) -> Hashable:
    """Requests batch together only when every input matches in name, datatype and non-batch dims."""
    if len(request.inputs) == 1:  # most requests: no sorting needed
        (tensor,) = request.inputs
        return ((tensor.name, tensor.datatype.value, tensor.shape[1:]),)
    return tuple(sorted((t.name, t.datatype.value, t.shape[1:]) for t in request.inputs))


@dataclass(eq=False)
class Pending:
    """A queued request and where its answer goes."""

    request: InferRequest
    rows: int
    signature: Hashable
    priority: int
    enqueued_ns: int
    deadline_ns: int  # 0 = no timeout
    seq: int
    # Where the answer goes: an asyncio future for a caller on an event loop (answered on that loop together with
    # the rest of its batch), a concurrent future for a blocking caller.
    answer: Answer = field(default_factory=Future)


@dataclass
class Batch:
    items: list[Pending]
    expired: list[Pending]
    wake_at_ns: int | None  # when to look again if nothing was formed; None = on the next arrival

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.items)


class BatchQueue:
    def __init__(self, model: str, policy: BatchingPolicy) -> None:
        self.model = model
        self.policy = policy
        self._levels: dict[int, collections.deque[Pending]] = {
            level: collections.deque() for level in range(1, policy.priority_levels + 1)}
        self._delayed: collections.deque[Pending] = collections.deque()
        self._last_rows = 0  # rows of the last batch formed

    def __len__(self) -> int:
        return sum(len(q) for q in self._levels.values()) + len(self._delayed)

    @property
    def last_rows(self) -> int:
        """The rows of the last batch formed (0 before the first)."""
        return self._last_rows

    def put(self, item: Pending) -> None:
        queue = self._levels[item.priority]
        limit = self.policy.queue_policy(item.priority).max_queue_size
        # A joined request (kiln.v2.joined) counts as the clients' requests it stands for, as they would queued
        # one by one; one that does not fit whole is refused whole (its sender then queues its members alone).
        if limit and sum(p.request.members for p in queue) + item.request.members > limit:
            raise QueueFullError(f"model '{self.model}': the queue of priority level {item.priority} is full "
                                 f"({limit} requests, max_queue_size); retry later")
        queue.append(item)

    def drain(self) -> list[Pending]:
        items = [p for q in self._queues() for p in q]
        for queue in self._queues():
            queue.clear()
        return items

    def next_batch(self, now_ns: int) -> Batch:
        expired = self._expire(now_ns)
        items, blocked = self._candidates()
        if not items:
            return Batch([], expired, self._next_deadline())
        chosen = self._choose(items, blocked, now_ns)
        if chosen is None:
            oldest = min(p.enqueued_ns for p in items)
            wake = oldest + self.policy.max_queue_delay_ns
            deadline = self._next_deadline()
            return Batch([], expired, wake if deadline is None else min(wake, deadline))
        self._remove(chosen)
        self._last_rows = sum(p.rows for p in chosen)
        return Batch(chosen, expired, None)

    def _queues(self) -> Iterator[collections.deque[Pending]]:
        yield from self._levels.values()
        yield self._delayed

    def _expire(self, now_ns: int) -> list[Pending]:
        expired: list[Pending] = []
        for level, queue in self._levels.items():
            if not any(p.deadline_ns and p.deadline_ns <= now_ns for p in queue):
                continue
            keep: collections.deque[Pending] = collections.deque()
            for p in queue:
                if p.deadline_ns and p.deadline_ns <= now_ns:
                    if self.policy.queue_policy(level).delay_on_timeout:
                        p.deadline_ns = 0
                        self._delayed.append(p)
                    else:
                        expired.append(p)
                else:
                    keep.append(p)
            self._levels[level] = keep
        return expired

    def _candidates(self) -> tuple[list[Pending], bool]:
        """The longest run, in service order, of compatible requests that fits; and whether it was cut short."""
        items: list[Pending] = []
        rows = 0
        for queue in self._queues():
            for p in queue:
                if items and (p.signature != items[0].signature or rows + p.rows > self.policy.max_batch_size):
                    return items, True
                items.append(p)
                rows += p.rows
        return items, False

    def _choose(self, items: list[Pending], blocked: bool, now_ns: int) -> list[Pending] | None:
        rows = sum(p.rows for p in items)
        preferred = self.policy.preferred_batch_sizes
        if preferred:
            total, best = 0, 0
            for index, p in enumerate(items):
                total += p.rows
                if total in preferred:
                    best = index + 1
            if best:
                return items[:best]
        if rows >= self.policy.max_batch_size or blocked or self.policy.max_queue_delay_ns == 0:
            return items
        if self.policy.delay_needs_company and rows >= self._last_rows:
            return items  # everyone the last batch held is here (or it held fewer): nobody else to wait for
        if now_ns - min(p.enqueued_ns for p in items) >= self.policy.max_queue_delay_ns:
            return items
        return None

    def _remove(self, chosen: list[Pending]) -> None:
        remaining = len(chosen)
        for queue in self._queues():
            while remaining and queue:
                queue.popleft()
                remaining -= 1

    def _next_deadline(self) -> int | None:
        deadlines = [p.deadline_ns for q in self._levels.values() for p in q if p.deadline_ns]
        return min(deadlines) if deadlines else None
