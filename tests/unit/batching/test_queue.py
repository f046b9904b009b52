"""Batch formation under a fake clock: which requests go together, in which order, and when."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.batching.policy import BatchingPolicy, QueuePolicy
from kiln.batching.queue import BatchQueue, Pending
from kiln.errors import QueueFullError
from kiln.tensor import DataType
from kiln.v2.types import InferRequest, InputTensor

MS = 1_000_000


class Requests:
    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, rows: int = 1, width: int = 4, at_ns: int = 0, priority: int = 1,
                 deadline_ns: int = 0) -> Pending:
        self.seq += 1
        data = np.zeros((rows, width), np.float32)
        request = InferRequest("m", [InputTensor("x", DataType.FP32, data.shape, data)], id=str(self.seq))
        return Pending(request=request, rows=rows, signature=(width,), priority=priority, enqueued_ns=at_ns,
                       deadline_ns=deadline_ns, seq=self.seq)


def ids(items: list[Pending]) -> list[str]:
    return [p.request.id for p in items]


def queue(**policy: object) -> BatchQueue:
    return BatchQueue("m", BatchingPolicy(**{"max_batch_size": 8, **policy}))  # type: ignore[arg-type]


def test_no_delay_sends_everything_queued_at_once() -> None:
    q, make = queue(), Requests()
    for _ in range(3):
        q.put(make())
    batch = q.next_batch(0)
    assert ids(batch.items) == ["1", "2", "3"] and len(q) == 0


def test_rows_count_and_max_batch_size_caps_the_batch() -> None:
    q, make = queue(), Requests()
    for rows in (3, 4, 2):
        q.put(make(rows))
    first = q.next_batch(0)
    assert ids(first.items) == ["1", "2"] and first.rows == 7
    assert ids(q.next_batch(0).items) == ["3"]


def test_incompatible_shapes_are_not_batched_and_order_is_kept() -> None:
    q, make = queue(), Requests()
    q.put(make(width=4))
    q.put(make(width=5))
    q.put(make(width=4))
    assert ids(q.next_batch(0).items) == ["1"]
    assert ids(q.next_batch(0).items) == ["2"]
    assert ids(q.next_batch(0).items) == ["3"]


def test_delay_waits_for_more_until_the_oldest_has_waited_long_enough() -> None:
    q, make = queue(max_queue_delay_ns=5 * MS), Requests()
    q.put(make(at_ns=0))
    waiting = q.next_batch(1 * MS)
    assert waiting.items == [] and waiting.wake_at_ns == 5 * MS
    q.put(make(at_ns=2 * MS))
    assert q.next_batch(4 * MS).items == []
    assert ids(q.next_batch(5 * MS).items) == ["1", "2"]


def test_full_batch_goes_before_the_delay() -> None:
    q, make = queue(max_queue_delay_ns=50 * MS), Requests()
    q.put(make(rows=4))
    assert q.next_batch(0).items == []
    q.put(make(rows=4))
    assert ids(q.next_batch(1).items) == ["1", "2"]


def test_largest_preferred_size_goes_at_once() -> None:
    q, make = queue(max_queue_delay_ns=50 * MS, preferred_batch_sizes=(2, 4)), Requests()
    for _ in range(5):
        q.put(make())
    assert ids(q.next_batch(0).items) == ["1", "2", "3", "4"]
    assert q.next_batch(0).items == []  # one left: not preferred, delay not reached
    assert ids(q.next_batch(50 * MS).items) == ["5"]


def test_priority_levels_are_served_highest_first() -> None:
    policy = {level: QueuePolicy() for level in (1, 2)}
    q, make = queue(priority_levels=2, queue_policies=policy, max_batch_size=2), Requests()
    q.put(make(priority=2))
    q.put(make(priority=2))
    q.put(make(priority=1))
    assert ids(q.next_batch(0).items) == ["3", "1"]
    assert ids(q.next_batch(0).items) == ["2"]


def test_full_queue_rejects_at_once() -> None:
    q, make = queue(queue_policies={1: QueuePolicy(max_queue_size=2)}), Requests()
    q.put(make())
    q.put(make())
    with pytest.raises(QueueFullError, match="max_queue_size"):
        q.put(make())


def test_timed_out_requests_are_rejected_and_never_run() -> None:
    q, make = queue(max_queue_delay_ns=10 * MS, queue_policies={1: QueuePolicy(timeout_us=1000)}), Requests()
    q.put(make(at_ns=0, deadline_ns=1 * MS))
    q.put(make(at_ns=0))
    batch = q.next_batch(2 * MS)
    assert ids(batch.expired) == ["1"] and batch.items == []
    assert ids(q.next_batch(10 * MS).items) == ["2"]


def test_delay_action_moves_timed_out_requests_behind_the_others() -> None:
    policies = {1: QueuePolicy(timeout_us=1000, delay_on_timeout=True)}
    q, make = queue(max_batch_size=1, queue_policies=policies), Requests()
    q.put(make(at_ns=0, deadline_ns=1 * MS))
    q.put(make(at_ns=0))
    batch = q.next_batch(2 * MS)
    assert batch.expired == [] and ids(batch.items) == ["2"]
    assert ids(q.next_batch(2 * MS).items) == ["1"]


def test_wake_time_accounts_for_the_next_deadline() -> None:
    q, make = queue(max_queue_delay_ns=10 * MS, queue_policies={1: QueuePolicy(timeout_us=3000)}), Requests()
    q.put(make(at_ns=0, deadline_ns=3 * MS))
    assert q.next_batch(0).wake_at_ns == 3 * MS


def test_a_joined_request_counts_as_its_members_against_max_queue_size() -> None:
    q, make = queue(queue_policies={1: QueuePolicy(max_queue_size=4)}), Requests()
    q.put(make())
    joined = make(rows=3)
    joined.request.members = 3
    q.put(joined)  # 1 + 3 fills the queue
    with pytest.raises(QueueFullError, match="max_queue_size"):
        q.put(make())


def test_a_joined_request_that_does_not_fit_whole_is_refused_whole() -> None:
    q, make = queue(queue_policies={1: QueuePolicy(max_queue_size=4)}), Requests()
    q.put(make())
    q.put(make())
    joined = make(rows=3)
    joined.request.members = 3
    with pytest.raises(QueueFullError):
        q.put(joined)
    q.put(make())  # what was refused took no room
    assert len(q) == 3
