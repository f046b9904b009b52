"""The threaded dynamic batcher with a recording engine: real threads, answers split back exactly."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from kiln.batching.dynamic import DynamicBatcher
from kiln.batching.policy import BatchingPolicy
from kiln.config import parse_config_text
from kiln.config.validate import validate_config
from kiln.engines.base import Array, Engine
from kiln.errors import InternalError, QueueFullError, RequestTimeoutError
from kiln.server.model import LoadedModel
from kiln.tensor import DataType
from kiln.v2.types import InferRequest, InferResponse, InputTensor

CONFIG = """
name: "double" backend: "identity" max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] } ]
dynamic_batching { %s }
"""


class GatedEngine(Engine):
    """Doubles its input; records batch sizes; waits on a gate so tests control when batches run."""

    def __init__(self, spec: object, fail_on: float | None = None) -> None:
        super().__init__(spec)  # type: ignore[arg-type]
        self.batches: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.fail_on = fail_on

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        self.started.set()
        self.gate.wait(10)
        x = inputs["x"]
        self.batches.append(x.shape[0])
        if self.fail_on is not None and (x == self.fail_on).any():
            raise RuntimeError("engine exploded")
        return {"y": x * 2}


def make(batching: str = "", engines: int = 1, **engine_args: object) -> tuple[DynamicBatcher, list[GatedEngine]]:
    config = parse_config_text(CONFIG % batching)
    spec = validate_config(config, "double", "config.pbtxt", None)
    instances = [GatedEngine(spec, **engine_args) for _ in range(engines)]  # type: ignore[arg-type]
    model = LoadedModel(spec, 1, Path("."), list(instances))
    return DynamicBatcher(model, BatchingPolicy.from_config(config)), instances


def request(value: float, rows: int = 1, width: int = 3, **parameters: object) -> InferRequest:
    data = np.full((rows, width), value, np.float32)
    return InferRequest("double", [InputTensor("x", DataType.FP32, data.shape, data)], id=str(value),
                        parameters=parameters)  # type: ignore[arg-type]


async def test_queued_requests_are_batched_and_split_back_exactly() -> None:
    batcher, (engine,) = make()
    engine.gate.clear()
    first = asyncio.ensure_future(batcher.submit(request(1.0), 1))
    await asyncio.to_thread(engine.started.wait, 5)
    rest = [asyncio.ensure_future(batcher.submit(request(float(v), rows=2), 2)) for v in (2, 3, 4)]
    await asyncio.sleep(0.05)
    engine.gate.set()
    responses = await asyncio.gather(first, *rest)
    assert engine.batches == [1, 6]
    for value, response in zip((1.0, 2.0, 3.0, 4.0), responses, strict=True):
        y = response.outputs[0].data
        assert response.id == str(value) and y.shape == ((1, 3) if value == 1.0 else (2, 3))
        assert (y == value * 2).all()
    stats = batcher.model.stats.snapshot()
    assert (stats.inference_count, stats.execution_count, stats.success.count) == (7, 2, 4)
    assert sorted(stats.batch_stats) == [1, 6]
    batcher.close()


async def test_a_failed_batch_answers_each_of_its_requests_with_the_error() -> None:
    batcher, (engine,) = make(fail_on=2.0)
    engine.gate.clear()
    blocker = asyncio.ensure_future(batcher.submit(request(1.0), 1))
    await asyncio.to_thread(engine.started.wait, 5)
    doomed = [asyncio.ensure_future(batcher.submit(request(v), 1)) for v in (2.0, 3.0)]
    await asyncio.sleep(0.05)
    engine.gate.set()
    await blocker
    for future in doomed:
        with pytest.raises(InternalError, match="engine exploded"):
            await future
    ok = await batcher.submit(request(5.0), 1)  # the worker lives on
    assert (ok.outputs[0].data == 10.0).all()
    assert batcher.model.stats.snapshot().fail.count == 2
    batcher.close()


async def test_full_queue_answers_unavailable_at_once() -> None:
    batcher, (engine,) = make("default_queue_policy { max_queue_size: 1 }")
    engine.gate.clear()
    running = asyncio.ensure_future(batcher.submit(request(1.0), 1))
    await asyncio.to_thread(engine.started.wait, 5)
    queued = asyncio.ensure_future(batcher.submit(request(2.0), 1))
    await asyncio.sleep(0.01)
    with pytest.raises(QueueFullError):
        await batcher.submit(request(3.0), 1)
    engine.gate.set()
    await asyncio.gather(running, queued)
    batcher.close()


async def test_timed_out_request_gets_its_own_error_and_never_runs() -> None:
    batcher, (engine,) = make("default_queue_policy { default_timeout_microseconds: 20000 }")
    engine.gate.clear()
    running = asyncio.ensure_future(batcher.submit(request(1.0), 1))
    await asyncio.to_thread(engine.started.wait, 5)
    late = asyncio.ensure_future(batcher.submit(request(7.0), 1))
    await asyncio.sleep(0.1)
    engine.gate.set()
    await running
    with pytest.raises(RequestTimeoutError, match="timed out"):
        await late
    assert engine.batches == [1]  # the timed-out request never reached the engine
    batcher.close()


async def test_preserve_ordering_releases_answers_in_arrival_order() -> None:
    batcher, (slow, fast) = make("preserve_ordering: true", engines=2)
    slow.gate.clear()
    order: list[str] = []

    async def track(value: float) -> None:
        response = await batcher.submit(request(value, width=4 if value == 1.0 else 3), 1)
        order.append(response.id)

    first = asyncio.ensure_future(track(1.0))
    await asyncio.to_thread(slow.started.wait, 5)
    second = asyncio.ensure_future(track(2.0))  # other shape: its own batch, on the free instance
    await asyncio.to_thread(fast.started.wait, 5)
    await asyncio.sleep(0.05)
    assert order == []  # the second is done but must wait for the first
    slow.gate.set()
    await asyncio.gather(first, second)
    assert order == ["1.0", "2.0"]
    batcher.close()


def test_close_runs_queued_requests_then_refuses_new_ones() -> None:
    batcher, (engine,) = make()
    futures: list[Future[InferResponse]] = [Future() for _ in range(3)]
    for v, future in enumerate(futures):
        batcher._enqueue(request(float(v)), 1, future)
    batcher.close()
    assert all(f.result(5).outputs[0].data.shape == (1, 3) for f in futures)
    with pytest.raises(Exception, match="unloading"):
        batcher.submit_sync(request(9.0), 1)


async def test_a_cancelled_client_neither_runs_nor_kills_the_worker() -> None:
    batcher, (engine,) = make()
    engine.gate.clear()
    running = asyncio.ensure_future(batcher.submit(request(1.0), 1))
    await asyncio.to_thread(engine.started.wait, 5)
    queued = asyncio.ensure_future(batcher.submit(request(2.0), 1))
    await asyncio.sleep(0.01)
    queued.cancel()  # gives up while queued
    running.cancel()  # gives up while its batch runs
    await asyncio.sleep(0.01)
    engine.gate.set()
    after = await asyncio.wait_for(batcher.submit(request(3.0), 1), 5)
    assert (after.outputs[0].data == 6.0).all()
    assert engine.batches == [1, 1]  # the cancelled queued request never ran
    assert batcher.model.stats.snapshot().failures_by_reason.get("CANCELED") == 1
    batcher.close()


async def test_a_batch_is_answered_on_the_loop_in_one_hand_off(hand_offs: list[object]) -> None:
    batcher, (engine,) = make()
    engine.gate.clear()
    first = asyncio.ensure_future(batcher.submit(request(1.0), 1))
    await asyncio.to_thread(engine.started.wait, 5)
    rest = [asyncio.ensure_future(batcher.submit(request(float(v)), 1)) for v in range(2, 8)]
    await asyncio.sleep(0.05)
    hand_offs.clear()
    engine.gate.set()
    responses = await asyncio.gather(first, *rest)
    assert engine.batches == [1, 6]
    assert [r.id for r in responses] == [str(float(v)) for v in range(1, 8)]
    assert len(hand_offs) == 2  # one per batch, not one per request
    batcher.close()
