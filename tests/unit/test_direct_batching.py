"""kiln.load() coalesces concurrent callers (threads, asyncio) into batches through the batching core.

A gated identity engine makes the timing deterministic: its first execution waits until the test has queued the
other callers, so what they coalesce into is known exactly. It records every batch it runs (rows and start time).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import kiln
from kiln.config.spec import ModelSpec
from kiln.direct import BatchingEngine
from kiln.engines.base import Engine, EngineOptions, register_backend
from kiln.errors import InvalidArgumentError, KilnError
from kiln.testing import onnx_identity_model, write_model

Array = npt.NDArray[Any]
BACKEND = "gated_for_direct_batching_test"


class GatedIdentity(Engine):
    """``y = x``; each execution records (rows, start time) and waits while ``gate`` is closed."""

    thread_safe = True

    def __init__(self, spec: ModelSpec, model_file: Path, options: EngineOptions) -> None:
        super().__init__(spec)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.batches: list[tuple[int, float]] = []
        self.threads: list[int] = []  # the thread each execution ran on
        self.closed = False

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        self.batches.append((len(inputs["x"]), time.monotonic()))
        self.threads.append(threading.get_ident())
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return {"y": np.array(inputs["x"])}

    def close(self) -> None:
        self.closed = True

    @property
    def rows(self) -> list[int]:
        return [rows for rows, _ in self.batches]


def _config(scheduling: str = "dynamic_batching { }", max_batch_size: int = 32) -> str:
    return (f'backend: "{BACKEND}" max_batch_size: {max_batch_size}\n'
            'input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
            'output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]\n' + scheduling + "\n")


@pytest.fixture(scope="module", autouse=True)
def _backend() -> None:
    register_backend(BACKEND, GatedIdentity)


def _load(tmp_path: Path, config: str | None = None, **kwargs: Any) -> Engine:
    kwargs.setdefault("batching", True)  # on the CPU it is off unless asked for
    return kiln.load(write_model(tmp_path, "gated", config=config or _config()), **kwargs)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[BatchingEngine]:
    loaded = _load(tmp_path)
    assert isinstance(loaded, BatchingEngine)
    yield loaded
    inner(loaded).gate.set()
    loaded.close()


def inner(engine: Engine) -> GatedIdentity:
    found = engine.engine if isinstance(engine, BatchingEngine) else engine
    assert isinstance(found, GatedIdentity)
    return found


def x(value: float, rows: int = 1) -> dict[str, Array]:
    return {"x": np.full((rows, 2), value, np.float32)}


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.001)


def call_in_threads(engine: Engine, values: Sequence[float]) -> tuple[list[threading.Thread], dict[float, Any]]:
    """Start one thread per value calling ``engine.infer``; the dict gets each value's output or error."""
    results: dict[float, Any] = {}

    def call(value: float) -> None:
        try:
            results[value] = engine.infer(x(value))["y"]
        except Exception as exc:
            results[value] = exc

    threads = [threading.Thread(target=call, args=(value,)) for value in values]
    for thread in threads:
        thread.start()
    return threads, results


def hold_first_batch(engine: BatchingEngine) -> tuple[list[threading.Thread], dict[float, Any]]:
    """A caller whose batch is executing (held at the gate): value 0."""
    gated = inner(engine)
    gated.gate.clear()
    threads, results = call_in_threads(engine, [0.0])
    assert gated.entered.wait(10)
    return threads, results


def queued(engine: BatchingEngine) -> int:
    return engine._batcher.inflight  # the callers accepted and not yet answered


def test_concurrent_threads_are_served_in_fewer_larger_batches(engine: BatchingEngine) -> None:
    first, results = hold_first_batch(engine)
    threads, more = call_in_threads(engine, [float(v) for v in range(1, 16)])
    wait_until(lambda: queued(engine) == 16, "15 callers are queued behind the running batch")
    inner(engine).gate.set()
    for thread in first + threads:
        thread.join(10)
    results.update(more)
    assert inner(engine).rows == [1, 15]  # 16 calls, 2 executions
    for value, output in results.items():
        np.testing.assert_array_equal(output, np.full((1, 2), value, np.float32))  # each caller its own rows
    assert engine.batch_log.executions == 2 and engine.batch_log.batch_sizes == {1: 1, 15: 1}


def test_a_lone_caller_does_not_wait_for_the_queue_delay(tmp_path: Path) -> None:
    delay_s = 5.0  # far above what a call takes: a call that waited for it shows in the batch's start time
    engine = _load(tmp_path, _config(f"dynamic_batching {{ max_queue_delay_microseconds: {int(delay_s * 1e6)} }}"))
    try:
        for value in range(3):
            called = time.monotonic()
            output = engine.infer(x(value))["y"]
            started = inner(engine).batches[-1][1]
            assert started - called < delay_s / 2
            np.testing.assert_array_equal(output, np.full((1, 2), value, np.float32))
        assert inner(engine).rows == [1, 1, 1]
        # ...and runs on the caller's own thread: no hand-off to the worker and back.
        assert inner(engine).threads == [threading.get_ident()] * 3
    finally:
        engine.close()


async def test_ainfer_callers_coalesce(engine: BatchingEngine) -> None:
    inner(engine).gate.clear()
    tasks = asyncio.gather(*(engine.ainfer(x(value)) for value in range(8)))
    await asyncio.to_thread(wait_until, lambda: queued(engine) == 8 and inner(engine).entered.is_set(),
                            "8 callers are in")
    inner(engine).gate.set()
    outputs = await tasks
    for value, output in enumerate(outputs):
        np.testing.assert_array_equal(output["y"], np.full((1, 2), value, np.float32))
    assert sum(inner(engine).rows) == 8 and len(inner(engine).rows) <= 2  # all queued while the first ran


def test_a_bad_caller_fails_alone(engine: BatchingEngine) -> None:
    first, results = hold_first_batch(engine)
    threads, more = call_in_threads(engine, [1.0, 2.0, 3.0])
    wait_until(lambda: queued(engine) == 4, "3 callers are queued")
    with pytest.raises(InvalidArgumentError, match=r"model 'gated'.*'x'"):
        engine.infer({"x": np.zeros((1, 3), np.float32)})  # wrong shape: refused before it joins a batch
    inner(engine).gate.set()
    for thread in first + threads:
        thread.join(10)
    results.update(more)
    assert inner(engine).rows == [1, 3]
    for value, output in results.items():
        np.testing.assert_array_equal(output, np.full((1, 2), value, np.float32))


def test_batching_off_runs_each_call_on_its_own(tmp_path: Path) -> None:
    engine = _load(tmp_path, batching=False)
    assert not isinstance(engine, BatchingEngine)
    threads, results = call_in_threads(engine, [float(v) for v in range(6)])
    for thread in threads:
        thread.join(10)
    assert inner(engine).rows == [1] * 6
    assert all(np.array_equal(results[v], np.full((1, 2), v, np.float32)) for v in results)


def test_batching_follows_the_config_on_a_gpu_unless_told(tmp_path: Path) -> None:
    # The test backend ignores the device, so kind="gpu" shows the default a GPU engine gets.
    on_gpu = kiln.load(write_model(tmp_path, "batched", config=_config()), kind="gpu")
    assert isinstance(on_gpu, BatchingEngine)
    on_gpu.close()
    on_cpu = kiln.load(tmp_path / "batched")
    assert isinstance(on_cpu, BatchingEngine) and not on_cpu.batch_threads  # only ainfer batches (next test)
    on_cpu.close()
    plain = kiln.load(write_model(tmp_path, "plain", config=_config("")), kind="gpu")
    assert not isinstance(plain, BatchingEngine)
    forced = kiln.load(tmp_path / "plain", batching=True)
    assert isinstance(forced, BatchingEngine) and forced.policy.max_batch_size == 32
    forced.close()
    write_model(tmp_path, "unbatched", config=_config("", max_batch_size=0))
    with pytest.raises(InvalidArgumentError, match=r"model 'unbatched'.*max_batch_size 0"):
        kiln.load(tmp_path / "unbatched", batching=True)


async def test_on_the_cpu_threads_run_on_their_own_and_coroutines_share_batches(tmp_path: Path) -> None:
    """Threads already run calls side by side there, and batching's bookkeeping would cost them more than it saves;
    coroutines would otherwise hop to a thread each, so they are batched as the server batches them."""
    engine = kiln.load(write_model(tmp_path, "cpu", config=_config()))
    assert isinstance(engine, BatchingEngine)
    gated = inner(engine)
    try:
        gated.gate.clear()
        threads, results = call_in_threads(engine, [1.0, 2.0, 3.0])
        wait_until(lambda: len(gated.batches) == 3, "the three threads ran at once, side by side")
        gated.gate.set()
        for thread in threads:
            thread.join(10)
        assert gated.rows == [1, 1, 1] and engine.batch_log.executions == 0  # none went through the batcher

        gated.gate.clear()
        gated.entered.clear()
        first = asyncio.ensure_future(engine.ainfer(x(4.0)))
        await asyncio.to_thread(gated.entered.wait, 10)  # the first runs: the rest queue behind it
        rest = [asyncio.ensure_future(engine.ainfer(x(float(v)))) for v in (5, 6, 7)]
        await asyncio.to_thread(wait_until, lambda: queued(engine) == 4, "three coroutines queued")
        gated.gate.set()
        answers = await asyncio.gather(first, *rest)
    finally:
        gated.gate.set()
        engine.close()
    assert [float(a["y"][0, 0]) for a in answers] == [4.0, 5.0, 6.0, 7.0]
    assert gated.rows[3:] == [1, 3]  # the three queued coroutines left as one batch
    assert all(np.array_equal(results[v], np.full((1, 2), v, np.float32)) for v in (1.0, 2.0, 3.0))
    with pytest.raises(KilnError, match="closed"):
        engine.infer(x(1.0))


def test_close_answers_the_queued_callers_then_refuses(engine: BatchingEngine) -> None:
    first, results = hold_first_batch(engine)
    threads, more = call_in_threads(engine, [1.0, 2.0])
    wait_until(lambda: queued(engine) == 3, "2 callers are queued")
    closer = threading.Thread(target=engine.close)
    closer.start()
    inner(engine).gate.set()
    closer.join(10)
    for thread in first + threads:
        thread.join(10)
    results.update(more)
    assert sorted(results) == [0.0, 1.0, 2.0]
    for value, output in results.items():
        np.testing.assert_array_equal(output, np.full((1, 2), value, np.float32))
    assert inner(engine).closed
    with pytest.raises(KilnError, match="unloading"):
        engine.infer(x(5.0))
    engine.close()  # idempotent


def test_onnx_runtime_engine_batches_threads_correctly(tmp_path: Path) -> None:
    config = ('platform: "onnxruntime_onnx" max_batch_size: 8\n'
              'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
              'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\ndynamic_batching { }\n')
    engine = kiln.load(write_model(tmp_path, "identity", onnx_identity_model(), config), batching=True)
    assert isinstance(engine, BatchingEngine)
    assert engine.providers == ["CPUExecutionProvider"]  # the wrapped engine's own attributes read through
    errors: list[str] = []

    def caller(index: int) -> None:
        for step in range(20):
            data = np.full((1 + step % 2, 4), index * 100 + step, np.float32)
            output = engine.infer({"INPUT0": data})["OUTPUT0"]
            if not np.array_equal(output, data):
                errors.append(f"caller {index} step {step} got {output}")

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    engine.close()
    assert not errors
    assert engine.batch_log.inferences == 8 * 30  # 8 callers x (10 one-row + 10 two-row calls)
    assert engine.batch_log.executions <= 8 * 20


LAUNCHING = "launching_for_direct_batching_test"


class _Flight:
    def __init__(self, engine: LaunchingIdentity, x: Array) -> None:
        self._engine = engine
        self._x = x

    def wait(self) -> None:
        time.sleep(0.002)  # a device working without the GIL

    def collect(self) -> dict[str, Array]:
        with self._engine.lock:
            self._engine.out -= 1
        return {"y": self._x}


class LaunchingIdentity(Engine):
    """A stand-in for a GPU engine that queues batches on its device (one at a time) and returns at once."""

    thread_safe = True
    launches = True
    created: list[LaunchingIdentity] = []

    def __init__(self, spec: ModelSpec, model_file: Path, options: EngineOptions) -> None:
        super().__init__(spec)
        self.lock = threading.Lock()
        self.out = 0
        self.launched: list[int] = []  # rows of each launched batch
        self.executed: list[int] = []  # the threads that ran a call with execute()
        self.closed = False
        LaunchingIdentity.created.append(self)

    def launch_parts(self, parts: Sequence[Mapping[str, Array]], outputs: Sequence[str]) -> _Flight | None:
        with self.lock:
            if self.out:
                return None
            self.out += 1
        x = np.concatenate([part["x"] for part in parts])
        self.launched.append(len(x))
        return _Flight(self, x)

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        self.executed.append(threading.get_ident())
        time.sleep(0.002)  # the device, synchronously
        return {"y": np.array(inputs["x"])}

    def close(self) -> None:
        self.closed = True


def test_on_a_launching_gpu_engine_threads_launch_batches_on_every_configured_instance(tmp_path: Path) -> None:
    register_backend(LAUNCHING, LaunchingIdentity)
    LaunchingIdentity.created.clear()
    config = _config().replace(BACKEND, LAUNCHING) + 'instance_group [ { kind: KIND_GPU count: 2 } ]\n'
    engine = kiln.load(write_model(tmp_path, "launching", config=config))
    assert isinstance(engine, BatchingEngine) and len(engine.engines) == 2  # the config's two GPU instances

    lone = engine.infer(x(5.0))["y"]  # a lone caller runs and waits on its own thread
    assert np.array_equal(lone, x(5.0)["x"])
    assert LaunchingIdentity.created[0].executed == [threading.get_ident()]

    values = [float(v) for v in range(1, 65)]
    errors: list[BaseException] = []

    def call(value: float) -> None:
        try:
            for _ in range(20):
                assert np.array_equal(engine.infer(x(value))["y"], x(value)["x"])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(v,)) for v in values]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    launched = [rows for each in LaunchingIdentity.created for rows in each.launched]
    assert all(each.launched for each in LaunchingIdentity.created), "both instances took batches"
    executed = sum(len(each.executed) for each in LaunchingIdentity.created)
    assert max(launched) > 1 and sum(launched) + executed == 64 * 20 + 1  # every call ran exactly once
    assert {thread.name for thread in threading.enumerate()} >= {"kiln-launching-1-launched"}  # the device waiter
    engine.close()
    assert not [thread.name for thread in threading.enumerate() if thread.name.startswith("kiln-launching-")]
    assert all(each.closed for each in LaunchingIdentity.created)


def test_on_the_cpu_the_direct_engine_keeps_one_instance(tmp_path: Path) -> None:
    config = _config() + 'instance_group [ { kind: KIND_CPU count: 3 } ]\n'
    engine = kiln.load(write_model(tmp_path, "cpu3", config=config), batching=True)
    assert isinstance(engine, BatchingEngine) and len(engine.engines) == 1
    engine.close()
