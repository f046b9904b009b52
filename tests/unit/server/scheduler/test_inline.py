"""Fast models run on the event loop thread, batched per loop turn; slow or unsafe ones never do."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest

from kiln.batching import inline
from kiln.batching.inline import MIN_SAMPLES, InlineRunner, inline_mode
from kiln.batching.policy import BatchingPolicy
from kiln.config import parse_config_text
from kiln.config.validate import validate_config
from kiln.engines.base import Array, Engine
from kiln.errors import InvalidArgumentError
from kiln.server.model import LoadedModel
from kiln.server.scheduler import DirectScheduler, DynamicBatcher
from kiln.tensor import DataType
from kiln.v2.types import InferRequest, InputTensor

CONFIG = """
name: "m" backend: "identity" max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
%s
"""


class ThreadRecordingEngine(Engine):
    thread_safe = True

    def __init__(self, spec: object) -> None:
        super().__init__(spec)  # type: ignore[arg-type]
        self.calls: list[tuple[str, int]] = []

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        self.calls.append((threading.current_thread().name, inputs["x"].shape[0]))
        return {"y": inputs["x"] + 1}


def model(extra: str = "", safe: bool = True) -> tuple[LoadedModel, ThreadRecordingEngine]:
    spec = validate_config(parse_config_text(CONFIG % extra), "m", "config.pbtxt", None)
    engine = ThreadRecordingEngine(spec)
    engine.thread_safe = safe
    return LoadedModel(spec, 1, Path("."), [engine]), engine


def request(value: float = 1.0) -> InferRequest:
    x = np.full((1, 2), value, np.float32)
    return InferRequest("m", [InputTensor("x", DataType.FP32, x.shape, x)])


async def warm_up(scheduler: DynamicBatcher | DirectScheduler) -> None:
    for _ in range(MIN_SAMPLES):
        await scheduler.submit(request(), 1)


async def test_fast_model_switches_to_inline_and_batches_one_loop_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inline, "FAST_NS", 10**10)  # "fast" must not depend on how busy the test machine is
    loaded, engine = model("dynamic_batching { }")
    batcher = DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config))
    await warm_up(batcher)
    assert all(name.startswith("kiln-m-1") for name, _ in engine.calls)  # worker threads while learning
    engine.calls.clear()
    answers = await asyncio.gather(*(batcher.submit(request(float(i)), 1) for i in range(5)))
    assert engine.calls == [(threading.current_thread().name, 5)]  # one batch, on the loop thread
    assert [float(a.outputs[0].data[0, 0]) for a in answers] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert loaded.stats.snapshot().success.count == MIN_SAMPLES + 5
    batcher.close()


async def test_inline_respects_max_batch_size_and_shapes() -> None:
    loaded, engine = model('dynamic_batching { } parameters { key: "inline_execution" value { string_value: "on" } }')
    batcher = DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config))
    big = np.ones((6, 2), np.float32)
    requests = [InferRequest("m", [InputTensor("x", DataType.FP32, big.shape, big)]) for _ in range(2)]
    await asyncio.gather(*(batcher.submit(r, 6) for r in requests), batcher.submit(request(), 1))
    assert [rows for _, rows in engine.calls] == [6, 7]
    batcher.close()


async def test_queue_policies_keep_requests_on_the_worker_queue() -> None:
    loaded, engine = model('dynamic_batching { max_queue_delay_microseconds: 100 } '
                           'parameters { key: "inline_execution" value { string_value: "on" } }')
    batcher = DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config))
    await batcher.submit(request(), 1)
    assert engine.calls[0][0].startswith("kiln-m-1")
    batcher.close()


async def test_direct_scheduler_runs_inline_when_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inline, "FAST_NS", 10**10)
    loaded, engine = model()
    scheduler = DirectScheduler(loaded)
    await warm_up(scheduler)
    engine.calls.clear()
    await scheduler.submit(request(), 1)
    assert engine.calls == [(threading.current_thread().name, 1)]
    scheduler.close()


def test_modes() -> None:
    assert inline_mode(model()[0]) == "auto"
    assert inline_mode(model(safe=False)[0]) == "off"  # engines not safe across threads never run inline
    off = model('parameters { key: "inline_execution" value { string_value: "off" } }')[0]
    assert not InlineRunner(off, 8, lambda r: None).wanted()
    with pytest.raises(InvalidArgumentError, match="'inline_execution' is 'sometimes'"):
        inline_mode(model('parameters { key: "inline_execution" value { string_value: "sometimes" } }')[0])


async def test_slow_model_stays_on_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inline, "FAST_NS", 0)  # every execution counts as slow
    loaded, engine = model("dynamic_batching { }")
    batcher = DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config))
    await warm_up(batcher)
    await batcher.submit(request(), 1)
    assert all(name.startswith("kiln-m-1") for name, _ in engine.calls)
    batcher.close()
