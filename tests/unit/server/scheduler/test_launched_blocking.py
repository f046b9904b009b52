"""Blocking callers (the direct engine's threads) launch batches as event loops do, without a loop in between: each
caller launches what the rules allow from its own thread, and the device waiter answers and launches what waits."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kiln.batching.policy import BatchingPolicy
from kiln.errors import InternalError, InvalidArgumentError, VersionUnloadingError
from kiln.server.scheduler import DynamicBatcher
from kiln.v2.types import InferResponse

from .test_launched import OVERLAP, SlotEngine, model, request


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.001)


class Callers:
    """Blocking callers on threads of their own; ``answers`` maps each value sent to its answer or error."""

    def __init__(self, batcher: DynamicBatcher) -> None:
        self.batcher = batcher
        self.answers: dict[float, Any] = {}
        self.threads: list[threading.Thread] = []

    def send(self, value: float) -> None:
        def call() -> None:
            try:
                self.answers[value] = value_of(self.batcher.submit_launched_sync(request(value), 1))
            except BaseException as exc:
                self.answers[value] = exc

        thread = threading.Thread(target=call)
        self.threads.append(thread)
        thread.start()

    def join(self) -> dict[float, Any]:
        for thread in self.threads:
            thread.join(10)
        assert not any(thread.is_alive() for thread in self.threads), "a caller was never answered"
        return self.answers


def value_of(response: InferResponse) -> float:
    return float(response.outputs[0].data[0, 0])


def batcher_over(engines_and_model: tuple[Any, list[SlotEngine]], device_s: float) -> tuple[DynamicBatcher,
                                                                                            list[SlotEngine]]:
    loaded, engines = engines_and_model
    for engine in engines:
        engine.device_s = device_s
    return DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config)), engines


def test_callers_arriving_while_the_batch_is_out_leave_together_launched_by_the_device_waiter() -> None:
    batcher, (engine,) = batcher_over(model(slots=4), 0.5)  # long enough for all six to arrive while it runs
    callers = Callers(batcher)
    try:
        callers.send(0.0)
        wait_until(lambda: engine.batches == [1], "the lone caller launched at once")
        for value in range(1, 6):
            callers.send(float(value))
        wait_until(lambda: batcher.inflight == 6, "all six were admitted")
        assert engine.batches == [1]  # one batch per instance: the five wait for the first to come back
        answers = callers.join()
    finally:
        batcher.close()
    assert answers == {float(v): float(v) + 1 for v in range(6)}
    assert engine.batches == [1, 5] and engine.free == 4 and engine.executed == 0
    waiter = "kiln-m-1-launched"
    assert waiter in engine.launch_threads and len(engine.launch_threads) == 2  # a caller's thread, then the waiter
    stats = batcher.model.stats.snapshot()
    assert stats.inference_count == 6 and stats.execution_count == 2


def test_a_second_instance_takes_a_batch_once_callers_reach_launch_overlap_rows() -> None:
    loaded, engines = model(parameters=OVERLAP % 2, instances=2, slots=1)
    batcher, engines = batcher_over((loaded, engines), 0.3)
    callers = Callers(batcher)
    try:
        callers.send(1.0)
        wait_until(lambda: sorted(engines[0].batches + engines[1].batches) == [1], "the first launched")
        callers.send(2.0)
        wait_until(lambda: batcher.inflight == 2, "the second was admitted")
        assert sorted(engines[0].batches + engines[1].batches) == [1]  # 1 out and 1 waiting: company is coming
        callers.send(3.0)
        wait_until(lambda: sorted(engines[0].batches + engines[1].batches) == [1, 2], "two rows started")
        assert 1.0 not in callers.answers  # beside the batch out, not after it
        answers = callers.join()
    finally:
        batcher.close()
    assert answers == {1.0: 2.0, 2.0: 3.0, 3.0: 4.0}


def test_blocking_callers_and_an_event_loop_share_the_instances_and_every_call_is_answered_once() -> None:
    loaded, engines = model(instances=2, slots=1)
    batcher, engines = batcher_over((loaded, engines), 0.002)
    callers = Callers(batcher)
    results: list[float] = []

    async def on_a_loop() -> None:
        for i in range(40):
            results.append(value_of(await batcher.submit(request(1000.0 + i), 1)))

    try:
        loop_thread = threading.Thread(target=lambda: asyncio.run(on_a_loop()))
        loop_thread.start()
        for value in range(40):
            callers.send(float(value))
        answers = callers.join()
        loop_thread.join(10)
    finally:
        batcher.close()
    assert answers == {float(v): float(v) + 1 for v in range(40)}
    assert results == [1001.0 + i for i in range(40)]
    assert sum(engines[0].batches + engines[1].batches) == 80
    assert all(launched.collected for engine in engines for launched in engine.launched)


def test_a_failed_launch_or_device_fails_its_own_callers_only() -> None:
    batcher, (engine,) = batcher_over(model(), 0.001)
    try:
        with pytest.raises(InternalError, match="negative input"):
            batcher.submit_launched_sync(request(-1.0), 1)
        assert value_of(batcher.submit_launched_sync(request(3.0), 1)) == 4.0
        engine.fail_on_device = True
        with pytest.raises(InternalError, match="the device failed"):
            batcher.submit_launched_sync(request(3.0), 1)
        engine.fail_on_device = False
        assert value_of(batcher.submit_launched_sync(request(4.0), 1)) == 5.0
    finally:
        batcher.close()
    assert engine.free == 2 and all(launched.collected for launched in engine.launched)
    assert batcher.model.stats.snapshot().fail.count == 2


def test_blocking_callers_retry_while_another_caller_holds_every_slot() -> None:
    """With none of the runner's batches out, no finished batch would wake them: they retry on a timer."""
    batcher, (engine,) = batcher_over(model(slots=1), 0.001)
    engine.free = 0  # held elsewhere
    callers = Callers(batcher)
    try:
        callers.send(1.0)
        time.sleep(0.02)
        assert not callers.answers and not engine.batches
        with engine.lock:
            engine.free = 1  # given back by a thread this runner knows nothing of
        answers = callers.join()
    finally:
        batcher.close()
    assert answers == {1.0: 2.0} and engine.batches == [1]


def test_closing_answers_the_waiting_blocking_callers_then_refuses_new_ones() -> None:
    batcher, (engine,) = batcher_over(model(), 0.05)
    callers = Callers(batcher)
    callers.send(1.0)
    wait_until(lambda: engine.batches == [1], "the first launched")
    for value in (2.0, 3.0):
        callers.send(value)
    wait_until(lambda: batcher.inflight == 3, "all three were admitted")
    batcher.close()
    assert callers.join() == {1.0: 2.0, 2.0: 3.0, 3.0: 4.0}
    with pytest.raises(VersionUnloadingError, match="unloading"):
        batcher.submit_launched_sync(request(1.0), 1)


def test_bad_parameters_are_refused_and_a_runner_that_cannot_launch_takes_the_worker_path() -> None:
    batcher, (engine,) = batcher_over(model(), 0.001)
    bad = request(1.0)
    bad.parameters["priority"] = "high"
    try:
        with pytest.raises(InvalidArgumentError, match="priority"):
            batcher.submit_launched_sync(bad, 1)
    finally:
        batcher.close()
    assert not engine.batches

    off = 'parameters { key: "launch_execution" value { string_value: "off" } }'
    batcher, (engine,) = batcher_over(model(parameters=off), 0.001)
    try:
        assert value_of(batcher.submit_launched_sync(request(np.float32(2.0).item()), 1)) == 3.0
    finally:
        batcher.close()
    assert engine.executed == 1 and not engine.batches


def test_the_device_waiter_lives_on_when_answering_a_batch_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    batcher, (engine,) = batcher_over(model(), 0.001)
    launcher = batcher._launcher
    flush_waiting = launcher._flush_waiting
    broken = [True]

    def once_broken(here: object) -> None:
        if broken.pop() if broken else False:
            raise RuntimeError("a bug after the answers went out")
        flush_waiting(here)  # type: ignore[arg-type]

    monkeypatch.setattr(launcher, "_flush_waiting", once_broken)
    callers = Callers(batcher)
    try:
        first = value_of(batcher.submit_launched_sync(request(1.0), 1))
        callers.send(2.0)  # on a thread: without a waiter it would never be answered
        answers = callers.join()
    finally:
        batcher.close()
    assert first == 2.0 and answers == {2.0: 3.0} and not broken and engine.batches == [1, 1]
