"""Request-rate mode's schedule, driven by made-up times (no clock, no sleeps)."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.bench.schedule import DELAY_TOLERANCE_NS, Pacer, SendCounts, SlotPool

SECOND = 1_000_000_000


def run_on_time(pacer: Pacer, until_ns: int) -> list[int]:
    """A sender that wakes exactly when told to and always finds a free slot."""
    sent: list[int] = []
    now = pacer.due_ns
    while now < until_ns:
        now += pacer.wait_ns(now)
        if now >= until_ns:
            break
        due = pacer.take(now, slot_free=True)
        assert due is not None
        sent.append(due)
    return sent


def test_constant_rate_sends_evenly_spaced_from_the_start() -> None:
    pacer = Pacer(10.0, "constant", start_ns=5 * SECOND)
    sent = run_on_time(pacer, 6 * SECOND)
    assert sent == [5 * SECOND + i * SECOND // 10 for i in range(10)]
    assert pacer.counts() == SendCounts(scheduled=10, delayed=0, dropped=0)


def test_wait_is_the_time_left_until_the_next_send() -> None:
    pacer = Pacer(4.0, "constant", start_ns=0)
    assert pacer.wait_ns(0) == 0
    pacer.take(0, slot_free=True)
    assert pacer.wait_ns(100_000_000) == 150_000_000
    assert pacer.wait_ns(400_000_000) == 0  # overdue


def test_a_send_later_than_the_tolerance_counts_as_delayed() -> None:
    pacer = Pacer(1000.0, "constant", start_ns=0)
    pacer.take(DELAY_TOLERANCE_NS, slot_free=True)  # due at 0, exactly at the tolerance: on time
    pacer.take(1_000_000 + DELAY_TOLERANCE_NS + 1, slot_free=True)  # due at 1 ms, 1 ms + 1 ns late
    assert pacer.counts() == SendCounts(scheduled=2, delayed=1, dropped=0)


def test_a_late_sender_catches_up_with_a_burst_of_delayed_sends() -> None:
    pacer = Pacer(100.0, "constant", start_ns=0)
    now = 95_000_000  # woke up 95 ms late: 10 sends are due (0, 10, ..., 90 ms)
    sent = []
    while pacer.wait_ns(now) == 0:
        sent.append(pacer.take(now, slot_free=True))
    assert sent == [i * 10_000_000 for i in range(10)]
    assert pacer.delayed == 10  # even the last one, due at 90 ms, goes out 5 ms late
    assert pacer.due_ns == 100_000_000


def test_a_send_with_no_free_slot_is_dropped_not_sent() -> None:
    pacer = Pacer(10.0, "constant", start_ns=0)
    assert pacer.take(0, slot_free=False) is None
    assert pacer.take(100_000_000, slot_free=True) == 100_000_000
    assert pacer.counts() == SendCounts(scheduled=2, delayed=0, dropped=1)


def test_poisson_gaps_average_the_requested_rate() -> None:
    pacer = Pacer(250.0, "poisson", start_ns=0, seed=3)
    sent = run_on_time(pacer, 200 * SECOND)
    gaps = np.diff(sent)
    assert len(sent) == pytest.approx(50_000, rel=0.03)
    assert gaps.mean() == pytest.approx(4_000_000, rel=0.03)
    assert gaps.std() == pytest.approx(4_000_000, rel=0.05)  # exponential: std equals the mean
    assert gaps.min() < 400_000 < 12_000_000 < gaps.max()


def test_poisson_schedule_repeats_with_its_seed() -> None:
    first = run_on_time(Pacer(100.0, "poisson", start_ns=0, seed=7), SECOND)
    second = run_on_time(Pacer(100.0, "poisson", start_ns=0, seed=7), SECOND)
    other = run_on_time(Pacer(100.0, "poisson", start_ns=0, seed=8), SECOND)
    assert first == second
    assert first != other


@pytest.mark.parametrize(("rate", "distribution"), [(0.0, "constant"), (-1.0, "poisson"), (5.0, "uniform")])
def test_pacer_refuses_bad_settings(rate: float, distribution: str) -> None:
    with pytest.raises(ValueError):
        Pacer(rate, distribution, start_ns=0)


def test_slot_pool_hands_out_the_lowest_free_slot() -> None:
    pool = SlotPool(3)
    assert [pool.acquire(), pool.acquire()] == [0, 1]
    pool.release(0)
    assert pool.acquire() == 0
    assert pool.acquire() == 2
    assert pool.acquire() is None
    assert pool.free == 0
    pool.release(1)
    assert pool.free == 1
    with pytest.raises(ValueError):
        SlotPool(0)
