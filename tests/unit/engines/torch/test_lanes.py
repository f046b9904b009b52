"""The lane pool (made on demand, reused, bounded) and the row staging buffers, on the CPU."""

from __future__ import annotations

import threading
import time
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from kiln.engines.torch import staging as staging_module
from kiln.engines.torch.lanes import LanePool
from kiln.engines.torch.staging import RowStaging, numpy_view


def test_a_free_lane_is_reused_before_a_new_one_is_made() -> None:
    made: list[int] = []
    pool = LanePool(lambda index: made.append(index) or f"lane{index}", limit=4)
    for _ in range(3):
        with pool.lane() as lane:
            assert lane == "lane0"
    assert made == [0] and pool.lanes == ("lane0",)


def test_concurrent_callers_get_distinct_lanes_up_to_the_limit() -> None:
    pool = LanePool(lambda index: index, limit=2)
    held: list[int] = []
    inside = threading.Barrier(2)
    release = threading.Event()
    waiter_got: list[int] = []

    def hold() -> None:
        with pool.lane() as lane:
            held.append(lane)
            inside.wait()
            release.wait()

    holders = [threading.Thread(target=hold) for _ in range(2)]
    for thread in holders:
        thread.start()
    while len(held) < 2:
        time.sleep(0.001)

    def third() -> None:
        with pool.lane() as lane:
            waiter_got.append(lane)

    waiter = threading.Thread(target=third)
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive() and waiter_got == []  # the limit is reached: the third caller waits
    release.set()
    for thread in [*holders, waiter]:
        thread.join()
    assert sorted(held) == [0, 1] and waiter_got[0] in (0, 1) and len(pool.lanes) == 2


def wait_until(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_waiting_callers_get_lanes_in_the_order_they_came() -> None:
    pool = LanePool(lambda index: index, limit=1)
    order: list[str] = []
    first = pool.try_take()
    assert first == 0 and pool.try_take() is None

    def caller(name: str) -> None:
        with pool.lane():
            order.append(name)

    threads = []
    for count, name in enumerate("abc", start=1):
        threads.append(threading.Thread(target=caller, args=(name,)))
        threads[-1].start()
        wait_until(lambda count=count: pool.waiting == count)  # a queued before b, b before c
    pool.give_back(first)
    for thread in threads:
        thread.join()
    assert order == ["a", "b", "c"] and pool.waiting == 0


def test_a_lane_given_back_goes_to_the_waiter_not_to_the_next_taker() -> None:
    pool = LanePool(lambda index: index, limit=1)
    lane = pool.try_take()
    assert lane is not None
    got: list[int] = []
    hold = threading.Event()

    def waiter() -> None:
        with pool.lane() as mine:
            got.append(mine)
            hold.wait()

    thread = threading.Thread(target=waiter)
    thread.start()
    wait_until(lambda: pool.waiting == 1)
    pool.give_back(lane)
    assert pool.try_take() is None  # this thread still holds the GIL, but the lane is the waiter's
    hold.set()
    thread.join()
    assert got == [0] and pool.try_take() == 0


def test_threads_beyond_the_lanes_all_make_progress() -> None:
    """Four threads on two lanes, each call waiting off the GIL while it holds its lane: every thread gets its
    turns. When a lane given back could be taken again by the thread that gave it, some threads got none."""
    pool = LanePool(lambda index: index, limit=2)
    counts = [0] * 4
    stop = time.monotonic() + 0.6

    def caller(slot: int) -> None:
        while time.monotonic() < stop:
            with pool.lane():
                time.sleep(0.002)
            counts[slot] += 1

    threads = [threading.Thread(target=caller, args=(slot,)) for slot in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert min(counts) >= max(counts) // 2 > 0, counts


def test_a_lane_that_fails_to_be_made_does_not_count_against_the_limit() -> None:
    attempts: list[int] = []

    def make(index: int) -> int:
        attempts.append(index)
        if len(attempts) == 1:
            raise RuntimeError("out of memory")
        return index

    pool = LanePool(make, limit=1)
    with pytest.raises(RuntimeError, match="out of memory"):
        pool.try_take()
    assert pool.try_take() == 1 and pool.lanes == (1,) and attempts == [0, 1]  # indices are never reused


def test_a_caller_waiting_on_a_lane_that_fails_to_be_made_makes_one_itself() -> None:
    making = threading.Event()
    fail = threading.Event()
    attempts: list[str] = []

    def make(index: int) -> int:
        attempts.append(threading.current_thread().name)
        if len(attempts) == 1:
            making.set()
            fail.wait()
            raise RuntimeError("out of memory")
        return index

    pool = LanePool(make, limit=1)
    errors: list[BaseException] = []
    got: list[int] = []

    def first() -> None:
        try:
            pool.try_take()
        except RuntimeError as exc:
            errors.append(exc)

    def second() -> None:
        with pool.lane() as lane:
            got.append(lane)

    maker = threading.Thread(target=first, name="first")
    maker.start()
    making.wait()
    waiter = threading.Thread(target=second, name="second")
    waiter.start()
    wait_until(lambda: pool.waiting == 1)  # the only lane is being made: it waits for it
    fail.set()
    maker.join()
    waiter.join(5)
    assert not waiter.is_alive(), "the waiter was left waiting for a lane that was never made"
    assert len(errors) == 1 and got == [1] and attempts == ["first", "second"]


def test_a_waiter_interrupted_by_a_signal_leaves_the_queue() -> None:
    """Ctrl-C while the main thread waits for a lane: the lane given back later must not go to the caller that
    left, or the pool would lose it for good."""
    import signal

    pool = LanePool(lambda index: index, limit=1)
    lane = pool.try_take()

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    try:
        with pytest.raises(KeyboardInterrupt), pool.lane():
            pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert pool.waiting == 0
    assert lane is not None
    pool.give_back(lane)
    assert pool.try_take() == lane


def test_try_take_does_not_wait_while_another_thread_makes_a_lane() -> None:
    """The event loop calls try_take: it must not sit behind a slow make (a CUDA stream and pinned buffers)."""
    making, finish = threading.Event(), threading.Event()

    def make(index: int) -> int:
        making.set()
        finish.wait()
        return index

    pool = LanePool(make, limit=2)
    maker = threading.Thread(target=lambda: pool.try_take())
    maker.start()
    making.wait()
    began = time.monotonic()
    assert pool.try_take() is None
    assert time.monotonic() - began < 0.5
    finish.set()
    maker.join()
    assert pool.lanes == (0,)


def test_a_pool_needs_at_least_one_lane() -> None:
    with pytest.raises(ValueError, match="limit of 1 or more, got 0"):
        LanePool(lambda index: index, limit=0)


def test_rows_of_each_part_land_back_to_back() -> None:
    staging = RowStaging(torch.float32, (2, 3), batching=True, max_rows=8, pinned=False)
    parts = [np.full((1, 2, 3), 1.0, np.float32), np.full((3, 2, 3), 2.0, np.float32),
             np.arange(12, dtype=np.float32).reshape(2, 2, 3)]
    filled = staging.fill(parts)
    assert filled.shape == (6, 2, 3) and filled.dtype == torch.float32
    np.testing.assert_array_equal(filled.numpy(), np.concatenate(parts))


def test_the_buffer_is_reused_and_grows_only_when_needed() -> None:
    staging = RowStaging(torch.int64, (4,), batching=True, max_rows=16, pinned=False)
    first = staging.fill([np.ones((3, 4), np.int64)])
    assert staging.capacity == 3
    second = staging.fill([np.zeros((2, 4), np.int64)])
    assert staging.capacity == 3 and second.data_ptr() == first.data_ptr()  # no new buffer for fewer rows
    staging.fill([np.ones((4, 4), np.int64)])
    assert staging.capacity == 6  # doubled
    staging.fill([np.ones((13, 4), np.int64)])
    assert staging.capacity == 13  # doubling gives 12, too few: exactly the rows asked for
    staging.fill([np.ones((14, 4), np.int64)])
    assert staging.capacity == 16  # doubling capped at max_rows


def test_a_model_without_batching_stages_its_whole_shape() -> None:
    staging = RowStaging(torch.float32, (2, 2), batching=False, max_rows=0, pinned=False)
    array = np.array([[1, 2], [3, 4]], np.float32)
    filled = staging.fill([array])
    assert filled.shape == (2, 2)
    np.testing.assert_array_equal(filled.numpy(), array)


def test_bfloat16_rows_keep_their_bits() -> None:
    staging = RowStaging(torch.bfloat16, (3,), batching=True, max_rows=4, pinned=False)
    array = np.array([[1.5, -2.0, 0.25]], dtype=ml_dtypes.bfloat16)
    filled = staging.fill([array, array])
    assert filled.dtype == torch.bfloat16
    np.testing.assert_array_equal(filled.float().numpy(), np.concatenate([array, array]).astype(np.float32))
    assert numpy_view(filled).dtype == np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("parallel_from", [0, 1 << 40])  # every fill shared by three threads, or by none
def test_read_only_strided_and_other_dtype_rows_are_staged_exactly(monkeypatch: pytest.MonkeyPatch,
                                                                   parallel_from: int) -> None:
    monkeypatch.setattr(staging_module, "PARALLEL_COPY_BYTES", parallel_from)
    monkeypatch.setattr(staging_module, "COPY_THREADS", 3)
    staging = RowStaging(torch.float32, (2, 3), batching=True, max_rows=8, pinned=False)
    received = np.frombuffer(np.arange(6, dtype=np.float32).tobytes(), np.float32).reshape(1, 2, 3)  # read-only
    strided = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(2, 2, 3) + 100)
    wider = np.full((1, 2, 3), 0.5, np.float64)
    filled = staging.fill([received, strided, wider])
    expected = np.concatenate([received, strided, wider.astype(np.float32)])
    assert filled.shape == (4, 2, 3)
    np.testing.assert_array_equal(filled.numpy(), expected)


@pytest.mark.parametrize("parallel_from", [0, 1 << 40])
def test_contiguous_parts_of_several_rows_land_in_order_whichever_copy_runs(monkeypatch: pytest.MonkeyPatch,
                                                                           parallel_from: int) -> None:
    monkeypatch.setattr(staging_module, "PARALLEL_COPY_BYTES", parallel_from)
    monkeypatch.setattr(staging_module, "COPY_THREADS", 3)
    staging = RowStaging(torch.float32, (3,), batching=True, max_rows=16, pinned=False)
    read_only = np.frombuffer(np.arange(6, dtype=np.float32).tobytes(), np.float32).reshape(2, 3)
    parts = [read_only, np.full((3, 3), 7.0, np.float32), np.arange(3, dtype=np.float32).reshape(1, 3) - 5]
    filled = staging.fill(parts)
    np.testing.assert_array_equal(filled.numpy(), np.concatenate(parts))
    again = staging.fill(parts[1:])  # a smaller batch reuses the buffer's first rows
    np.testing.assert_array_equal(again.numpy(), np.concatenate(parts[1:]))


def test_a_fill_whose_own_share_fails_returns_only_after_the_helpers_are_done(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The buffer is reused by the next fill: no helper may still be writing into it once fill has raised."""
    monkeypatch.setattr(staging_module, "PARALLEL_COPY_BYTES", 0)
    monkeypatch.setattr(staging_module, "COPY_THREADS", 2)
    copy_all = staging_module._copy_all
    finished: list[str] = []

    def slow_helper(placed: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.05)
            copy_all(placed)
            finished.append("helper")
            return
        copy_all(placed)

    monkeypatch.setattr(staging_module, "_copy_all", slow_helper)
    staging = RowStaging(torch.float32, (3,), batching=True, max_rows=8, pinned=False)
    with pytest.raises(ValueError):  # the caller's share (the first part) has the wrong row shape
        staging.fill([np.zeros((1, 4), np.float32), np.zeros((1, 3), np.float32)])
    assert finished == ["helper"]


@pytest.mark.parametrize("bad_at", [0, 1])  # the calling thread's share, or the helper's
def test_a_failed_shared_copy_raises_in_the_caller(monkeypatch: pytest.MonkeyPatch, bad_at: int) -> None:
    monkeypatch.setattr(staging_module, "PARALLEL_COPY_BYTES", 0)
    monkeypatch.setattr(staging_module, "COPY_THREADS", 2)
    staging = RowStaging(torch.float32, (3,), batching=True, max_rows=8, pinned=False)
    parts = [np.zeros((1, 3), np.float32), np.zeros((1, 3), np.float32)]
    parts[bad_at] = np.zeros((1, 4), np.float32)  # a part whose rows do not have the row shape
    with pytest.raises(ValueError):
        staging.fill(parts)
    np.testing.assert_array_equal(staging.fill([np.ones((2, 3), np.float32)]).numpy(), np.ones((2, 3)))


def test_request_rows_join_as_numpy_or_on_the_tensors_device() -> None:
    from kiln.engines.torch.engine import join_rows

    body = np.frombuffer(np.full(4, 3.0, np.float32).tobytes(), np.float32).reshape(1, 4)  # read-only, as received
    region = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    joined = join_rows([region, body, region[:1]])
    assert isinstance(joined, torch.Tensor) and joined.device == region.device
    np.testing.assert_array_equal(joined.numpy(), np.concatenate([region.numpy(), body, region[:1].numpy()]))
    numpy_only = join_rows([body, body])
    assert isinstance(numpy_only, np.ndarray) and numpy_only.shape == (2, 4)


def test_rows_hands_out_the_buffer_growing_it_when_needed() -> None:
    staging = RowStaging(torch.float32, (3,), batching=True, max_rows=8, pinned=False)
    two = staging.rows(2)
    assert two.shape == (2, 3) and staging.capacity == 2
    one = staging.rows(1)
    assert one.data_ptr() == two.data_ptr()  # the same buffer, no new allocation for fewer rows
    assert staging.rows(5).shape == (5, 3) and staging.capacity == 5
    whole = RowStaging(torch.int32, (2, 2), batching=False, max_rows=0, pinned=False).rows(1)
    assert whole.shape == (2, 2)
