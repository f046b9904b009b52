"""The direct engine's queue-delay rule (delay_needs_company) under a fake clock: the delay is waited only while
fewer rows are queued than the last batch held; a lone caller goes at once."""

from __future__ import annotations

import numpy as np

from kiln.batching.policy import BatchingPolicy
from kiln.batching.queue import BatchQueue, Pending
from kiln.tensor import DataType
from kiln.v2.types import InferRequest, InputTensor

DELAY_NS = 1_000_000


def pending(seq: int, at_ns: int, rows: int = 1) -> Pending:
    data = np.zeros((rows, 4), np.float32)
    request = InferRequest("m", [InputTensor("x", DataType.FP32, data.shape, data)], id=str(seq))
    return Pending(request=request, rows=rows, signature=(4,), priority=1, enqueued_ns=at_ns, deadline_ns=0,
                   seq=seq)


def queue(company: bool) -> BatchQueue:
    return BatchQueue("m", BatchingPolicy(max_batch_size=8, max_queue_delay_ns=DELAY_NS,
                                          delay_needs_company=company))


def test_a_lone_request_goes_at_once() -> None:
    q = queue(company=True)
    for seq in range(3):
        q.put(pending(seq, at_ns=seq * 10))
        assert [p.seq for p in q.next_batch(seq * 10).items] == [seq]


def test_after_a_batch_with_company_the_next_waits_for_it() -> None:
    q = queue(company=True)
    for seq in range(3):
        q.put(pending(seq, at_ns=0))
    assert len(q.next_batch(0).items) == 3  # the first batch: nobody seen before, no wait
    q.put(pending(3, at_ns=100))
    waiting = q.next_batch(100)
    assert not waiting.items and waiting.wake_at_ns == 100 + DELAY_NS  # 1 < 3 rows: the others may come back
    q.put(pending(4, at_ns=200))
    q.put(pending(5, at_ns=300))
    assert [p.seq for p in q.next_batch(300).items] == [3, 4, 5]  # as many as last time: no more waiting


def test_company_left_the_delay_still_bounds_the_wait() -> None:
    q = queue(company=True)
    for seq in range(2):
        q.put(pending(seq, at_ns=0))
    assert len(q.next_batch(0).items) == 2
    q.put(pending(2, at_ns=10))
    assert not q.next_batch(10).items
    assert [p.seq for p in q.next_batch(10 + DELAY_NS).items] == [2]
    q.put(pending(3, at_ns=20 + DELAY_NS))  # the last batch held one: a lone caller again
    assert [p.seq for p in q.next_batch(20 + DELAY_NS).items] == [3]


def test_the_servers_rule_waits_for_the_delay_even_alone() -> None:
    q = queue(company=False)
    q.put(pending(0, at_ns=0))
    assert not q.next_batch(0).items
    assert [p.seq for p in q.next_batch(DELAY_NS).items] == [0]
