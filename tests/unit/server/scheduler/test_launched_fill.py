"""Launched batches whose rows are copied on fill threads (``launch_fill``): the loop takes the buffers and
launches, a fill thread copies in between, and every way that can go wrong gives the buffers back."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest

from kiln.config import parse_config_text
from kiln.config.validate import validate_config
from kiln.engines.base import Array
from kiln.errors import InternalError, InvalidArgumentError
from kiln.server.model import LoadedModel
from kiln.server.scheduler import DynamicBatcher
from kiln.server.scheduler.launched import DEFAULT_FILL, fill_mode
from kiln.server.scheduler.policy import BatchingPolicy

from .test_launched import CONFIG, SlotEngine, _Launched, request


class _Staged:
    def __init__(self, engine: StagingEngine, parts: Sequence[Mapping[str, Array]]) -> None:
        self._engine = engine
        self._parts = parts
        self._x: Array | None = None
        self.abandoned = False

    def fill(self) -> None:
        engine = self._engine
        engine.fill_threads.add(threading.current_thread().name)
        time.sleep(engine.fill_s)  # copying without the GIL
        if engine.fail_fill:
            raise InternalError("model 'm': the fill failed")
        self._x = np.concatenate([part["x"] for part in self._parts])

    def launch(self) -> _Launched:
        engine, x = self._engine, self._x
        assert x is not None, "launched before it was filled"
        if float(x[0, 0]) < 0:
            self.abandon()
            raise InternalError("model 'm': negative input")
        engine.batches.append(int(x.shape[0]))
        engine.launch_threads.add(threading.current_thread().name)
        launched = _Launched(engine, x)
        engine.launched.append(launched)
        return launched

    def abandon(self) -> None:
        assert not self.abandoned, "abandoned twice"
        self.abandoned = True
        with self._engine.lock:
            self._engine.free += 1


class StagingEngine(SlotEngine):
    """SlotEngine that can also stage: ``stage_parts`` takes a slot on the calling thread (the loop)."""

    stages = True

    def __init__(self, spec: object, slots: int = 2, device_s: float = 0.01) -> None:
        super().__init__(spec, slots, device_s)
        self.fill_s = 0.0
        self.fail_fill = False
        self.fill_threads: set[str] = set()
        self.stage_threads: set[str] = set()
        self.launch_parts_calls = 0

    def stage_parts(self, parts: Sequence[Mapping[str, Array]], outputs: Sequence[str]) -> _Staged | None:
        with self.lock:
            if not self.free:
                return None
            self.free -= 1
            self.most_out = max(self.most_out, self.slots - self.free)
        self.stage_threads.add(threading.current_thread().name)
        return _Staged(self, parts)

    def launch_parts(self, parts: Sequence[Mapping[str, Array]], outputs: Sequence[str]) -> _Launched | None:
        self.launch_parts_calls += 1
        return super().launch_parts(parts, outputs)


def model(fill: str = "thread", instances: int = 1) -> tuple[LoadedModel, list[StagingEngine]]:
    parameters = f'parameters {{ key: "launch_fill" value {{ string_value: "{fill}" }} }}' if fill else ""
    spec = validate_config(parse_config_text(CONFIG % ("", parameters)), "m", "config.pbtxt", None)
    engines = [StagingEngine(spec) for _ in range(instances)]
    return LoadedModel(spec, 1, Path("."), list(engines)), engines


def batcher_for(loaded: LoadedModel) -> DynamicBatcher:
    return DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config))


async def test_rows_are_copied_on_a_fill_thread_while_the_loop_takes_the_slot_and_launches() -> None:
    loaded, engines = model(instances=2)
    for engine in engines:
        engine.fill_s = 0.002
    batcher = batcher_for(loaded)
    try:
        responses = await asyncio.gather(*(batcher.submit(request(float(i)), 1) for i in range(20)))
    finally:
        await asyncio.to_thread(batcher.close)
    assert [float(r.outputs[0].data[0, 0]) for r in responses] == [float(i + 1) for i in range(20)]
    loop_thread = threading.current_thread().name
    for engine in engines:
        assert engine.stage_threads == engine.launch_threads == {loop_thread}
        assert engine.fill_threads and all(name.startswith("kiln-m-1-fill") for name in engine.fill_threads)
        assert engine.launch_parts_calls == 0 and engine.most_out == 1 and engine.free == 2
    stats = loaded.stats.snapshot()
    assert stats.inference_count == 20 and stats.compute_input.ns >= 0.002 * 1e9 * stats.execution_count


async def test_launch_fill_loop_keeps_the_copy_on_the_event_loop() -> None:
    loaded, (engine,) = model(fill="loop")
    batcher = batcher_for(loaded)
    try:
        response = await batcher.submit(request(1.0), 1)
    finally:
        await asyncio.to_thread(batcher.close)
    assert float(response.outputs[0].data[0, 0]) == 2.0
    assert engine.launch_parts_calls == 1 and not engine.fill_threads


async def test_a_failed_fill_or_launch_fails_its_batch_only_and_gives_the_slot_back() -> None:
    loaded, (engine,) = model()
    batcher = batcher_for(loaded)
    try:
        engine.fail_fill = True
        with pytest.raises(InternalError, match="the fill failed"):
            await batcher.submit(request(1.0), 1)
        engine.fail_fill = False
        with pytest.raises(InternalError, match="negative input"):
            await batcher.submit(request(-1.0), 1)
        response = await batcher.submit(request(3.0), 1)
    finally:
        await asyncio.to_thread(batcher.close)
    assert float(response.outputs[0].data[0, 0]) == 4.0 and engine.free == 2
    assert loaded.stats.snapshot().fail.count == 2


async def test_closing_waits_for_a_batch_still_being_filled() -> None:
    loaded, (engine,) = model()
    engine.fill_s = 0.1
    batcher = batcher_for(loaded)
    running = asyncio.ensure_future(batcher.submit(request(1.0), 1))
    await asyncio.sleep(0.01)  # its rows are being copied
    closing = asyncio.ensure_future(asyncio.to_thread(batcher.close))
    assert float((await running).outputs[0].data[0, 0]) == 2.0
    await closing
    assert engine.free == 2


def test_a_batch_whose_event_loop_closed_while_it_was_filled_gives_its_slot_back() -> None:
    loaded, (engine,) = model()
    engine.fill_s = 0.05
    batcher = batcher_for(loaded)
    try:
        loop = asyncio.new_event_loop()
        task = loop.create_task(batcher.submit(request(1.0), 1))
        loop.run_until_complete(asyncio.sleep(0.005))  # being filled
        task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()

        async def later() -> float:
            response = await asyncio.wait_for(batcher.submit(request(2.0), 1), 5)
            return float(response.outputs[0].data[0, 0])

        assert asyncio.run(later()) == 3.0
    finally:
        batcher.close()
    assert engine.free == 2 and engine.batches == [1]  # the abandoned batch never reached the device
    assert loaded.stats.snapshot().fail.count == 1  # the abandoned request, counted as cancelled


def test_engines_that_cannot_stage_fill_on_the_loop_and_bad_values_are_named() -> None:
    assert fill_mode(model(fill="")[0]) == DEFAULT_FILL
    loaded, (engine,) = model()
    assert fill_mode(loaded) == "thread"
    engine.stages = False
    assert fill_mode(loaded) == "loop"
    loaded, _ = model(fill="sometimes")
    with pytest.raises(InvalidArgumentError, match="'launch_fill' is 'sometimes'; expected thread or loop"):
        fill_mode(loaded)
