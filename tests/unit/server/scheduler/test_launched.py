"""Engines that queue batches on a device are launched from the event loop and answered when the device is done."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest

from kiln.batching import loop_load
from kiln.batching.launched import launch_mode, overlap_rows
from kiln.batching.policy import BatchingPolicy
from kiln.config import parse_config_text
from kiln.config.validate import validate_config
from kiln.engines.base import Array, Engine
from kiln.errors import InternalError, InvalidArgumentError, VersionUnloadingError
from kiln.server.model import LoadedModel
from kiln.server.scheduler import DynamicBatcher
from kiln.server.scheduler.direct import DirectScheduler
from kiln.tensor import DataType
from kiln.testing.cpu import spin
from kiln.v2.types import InferRequest, InputTensor

CONFIG = """
name: "m" backend: "identity" max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
dynamic_batching { %s }
%s
"""


class _Launched:
    def __init__(self, engine: SlotEngine, x: Array) -> None:
        self._engine = engine
        self._x = x
        self._done_at = time.monotonic() + engine.device_s
        self.collected = False

    def wait(self) -> None:
        time.sleep(max(0.0, self._done_at - time.monotonic()))  # a device working without the GIL
        if self._engine.fail_on_device:
            raise InternalError("model 'm': the device failed")

    def collect(self) -> dict[str, Array]:
        assert not self.collected, "collected twice"
        self.collected = True
        with self._engine.lock:
            self._engine.free += 1
        return {"y": self._x + 1}


class SlotEngine(Engine):
    """A stand-in for a GPU engine: ``slots`` batches may be on the device at once, each taking ``device_s``."""

    launches = True

    def __init__(self, spec: object, slots: int = 2, device_s: float = 0.01) -> None:
        super().__init__(spec)  # type: ignore[arg-type]
        self.lock = threading.Lock()
        self.slots = slots
        self.free = slots
        self.most_out = 0  # the most batches on the device at once
        self.launch_s = 0.0  # time launch_parts spends without the GIL, as staging copies do
        self.device_s = device_s
        self.batches: list[int] = []
        self.launch_threads: set[str] = set()
        self.executed = 0
        self.fail_on_device = False
        self.launched: list[_Launched] = []

    def launch_parts(self, parts: Sequence[Mapping[str, Array]], outputs: Sequence[str]) -> _Launched | None:
        if self.launch_s:
            time.sleep(self.launch_s)
        with self.lock:
            if not self.free:
                return None
            self.free -= 1
            self.most_out = max(self.most_out, self.slots - self.free)
        x = np.concatenate([part["x"] for part in parts])
        if float(x[0, 0]) < 0:
            with self.lock:
                self.free += 1
            raise InternalError("model 'm': negative input")
        self.batches.append(int(x.shape[0]))
        self.launch_threads.add(threading.current_thread().name)
        launched = _Launched(self, x)
        self.launched.append(launched)
        return launched

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        self.executed += 1
        return {"y": inputs["x"] + 1}


def model(batching: str = "", parameters: str = "", instances: int = 1,
          slots: int = 2) -> tuple[LoadedModel, list[SlotEngine]]:
    spec = validate_config(parse_config_text(CONFIG % (batching, parameters)), "m", "config.pbtxt", None)
    engines = [SlotEngine(spec, slots) for _ in range(instances)]
    return LoadedModel(spec, 1, Path("."), list(engines)), engines


def request(value: float) -> InferRequest:
    x = np.full((1, 2), value, np.float32)
    return InferRequest("m", [InputTensor("x", DataType.FP32, x.shape, x)])


async def test_requests_of_one_turn_launch_as_one_batch_from_the_loop_and_each_gets_its_rows() -> None:
    loaded, (engine,) = model()
    batcher = DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config))
    try:
        responses = await asyncio.gather(*(batcher.submit(request(float(i)), 1) for i in range(5)))
    finally:
        await asyncio.to_thread(batcher.close)
    assert [float(r.outputs[0].data[0, 0]) for r in responses] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert engine.batches == [5] and engine.executed == 0
    assert engine.launch_threads == {threading.current_thread().name}  # the event loop's thread
    stats = loaded.stats.snapshot()
    assert stats.inference_count == 5 and stats.execution_count == 1


async def test_batches_wait_for_a_free_slot_and_overlap_up_to_the_slots_of_every_instance() -> None:
    loaded, engines = model(instances=2, slots=1)
    batcher = DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config))
    try:
        responses = await asyncio.gather(*(batcher.submit(request(float(i)), 1) for i in range(20)))
    finally:
        await asyncio.to_thread(batcher.close)
    assert sorted(float(r.outputs[0].data[0, 0]) for r in responses) == [float(i + 1) for i in range(20)]
    # 8 rows per batch at most; the first two batches launch at once, one per instance, the rest as slots free up
    batches = engines[0].batches + engines[1].batches
    assert sum(batches) == 20 and max(batches) == 8 and engines[0].batches and engines[1].batches
    assert all(launched.collected for engine in engines for launched in engine.launched)
    assert all(engine.free == 1 for engine in engines)


async def test_requests_arriving_while_the_instance_has_a_batch_out_leave_together_when_it_is_back() -> None:
    """Requests from the network arrive spread over loop turns. Launching each onto another free slot would send
    batches of one; they wait for the instance instead, as behind a busy Triton instance."""
    loaded, (engine,) = model(slots=4)
    engine.device_s = 0.05
    batcher = DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config))
    try:
        first = asyncio.ensure_future(batcher.submit(request(0.0), 1))
        later = []
        for i in range(5):
            await asyncio.sleep(0.001)  # one request per loop turn, while the first batch is on the device
            later.append(asyncio.ensure_future(batcher.submit(request(float(i + 1)), 1)))
        responses = await asyncio.gather(first, *later)
    finally:
        await asyncio.to_thread(batcher.close)
    assert [float(r.outputs[0].data[0, 0]) for r in responses] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert engine.batches == [1, 5] and engine.free == 4


OVERLAP = 'parameters { key: "launch_overlap_rows" value { string_value: "%s" } }'


async def _one_per_turn(batcher: DynamicBatcher, values: range) -> list[asyncio.Future[object]]:
    sent: list[asyncio.Future[object]] = []
    for value in values:
        sent.append(asyncio.ensure_future(batcher.submit(request(float(value)), 1)))
        await asyncio.sleep(0.002)  # the next request comes in a later loop turn, as from the network
    return sent


def _two_instances(overlap: int, device_s: float) -> tuple[DynamicBatcher, list[SlotEngine]]:
    """A batcher over two instances of one slot each, with ``launch_overlap_rows`` set."""
    loaded, engines = model(parameters=OVERLAP % overlap, instances=2, slots=1)
    for engine in engines:
        engine.device_s = device_s
    return DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config)), engines


async def _one_turn(batcher: DynamicBatcher, values: range) -> list[asyncio.Future[object]]:
    sent = [asyncio.ensure_future(batcher.submit(request(float(value)), 1)) for value in values]
    await asyncio.sleep(0.002)
    return sent


def _launched(engines: list[SlotEngine]) -> list[int]:
    return sorted(engines[0].batches + engines[1].batches)


async def test_while_a_batch_is_out_another_instance_starts_only_a_batch_of_launch_overlap_rows() -> None:
    """Under load (rows out and waiting reach launch_overlap_rows) the idle second instance does not take requests
    arriving one per turn as batches of one; they wait until they are enough, and start beside the batch out."""
    batcher, engines = _two_instances(4, 0.3)
    try:
        first = await _one_turn(batcher, range(3))
        assert _launched(engines) == [3]  # nothing was out: they left at once
        few = await _one_per_turn(batcher, range(3, 6))
        assert _launched(engines) == [3]  # 3 out and 1-3 waiting: company is coming
        rest = await _one_per_turn(batcher, range(6, 7))
        assert _launched(engines) == [3, 4]
        assert not first[0].done()  # the batch of four started while the first was still out
        responses = await asyncio.gather(*first, *few, *rest)
    finally:
        await asyncio.to_thread(batcher.close)
    assert [float(r.outputs[0].data[0, 0]) for r in responses] == [float(i + 1) for i in range(7)]  # type: ignore[attr-defined]


async def test_a_held_batch_leaves_when_the_batch_out_is_back() -> None:
    batcher, engines = _two_instances(4, 0.05)
    try:
        sent = [*await _one_turn(batcher, range(3)), *await _one_per_turn(batcher, range(3, 4))]
        assert _launched(engines) == [3]
        responses = await asyncio.gather(*sent)
    finally:
        await asyncio.to_thread(batcher.close)
    assert [float(r.outputs[0].data[0, 0]) for r in responses] == [1.0, 2.0, 3.0, 4.0]  # type: ignore[attr-defined]
    assert _launched(engines) == [1, 3]


async def test_below_launch_overlap_rows_in_flight_small_batches_start_side_by_side() -> None:
    """Two clients cannot fill a batch of 8: the second request starts on the idle instance at once."""
    batcher, engines = _two_instances(8, 0.3)
    try:
        sent = await _one_per_turn(batcher, range(2))
        assert engines[0].batches == [1] and engines[1].batches == [1]
        assert not sent[0].done()
        await asyncio.gather(*sent)
    finally:
        await asyncio.to_thread(batcher.close)


async def test_on_a_busy_event_loop_a_small_batch_waits_for_the_batch_out_whatever_the_rows_in_flight(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests that queue outside the loop (in sockets, in frontend workers) are not counted in the rows in flight:
    while the loop's own thread is busy, a batch below launch_overlap_rows waits for the batch out anyway."""
    monkeypatch.setattr(loop_load, "WINDOW_S", 0.02)
    monkeypatch.setattr(loop_load, "BUSY_SHARE", 0.5)  # a margin for a shared machine: the spin below runs ~1 core
    batcher, engines = _two_instances(8, 0.2)
    try:
        first = await _one_turn(batcher, range(1))
        assert _launched(engines) == [1]  # nothing was out: it left at once
        spin(0.05)  # the loop's thread works, as one answering many clients does
        second = await _one_turn(batcher, range(1, 2))
        assert _launched(engines) == [1]  # two rows in flight, far below 8, and yet it waits
        assert not first[0].done()
        responses = await asyncio.gather(*first, *second)
    finally:
        await asyncio.to_thread(batcher.close)
    assert [float(r.outputs[0].data[0, 0]) for r in responses] == [1.0, 2.0]  # type: ignore[attr-defined]
    assert _launched(engines) == [1, 1]


async def test_launch_overlap_rows_1_starts_every_batch_on_a_free_instance_at_once() -> None:
    batcher, engines = _two_instances(1, 0.3)
    try:
        sent = [*await _one_turn(batcher, range(3)), *await _one_per_turn(batcher, range(3, 4))]
        assert _launched(engines) == [1, 3]  # the fourth did not wait for the batch out, though the load was there
        assert not sent[0].done()
        await asyncio.gather(*sent)
    finally:
        await asyncio.to_thread(batcher.close)


@pytest.mark.parametrize(("batching", "parameters", "expected"), [
    ("preferred_batch_size: [ 2, 6 ]", "", 2),  # the smallest preferred batch size
    ("", "", 1),  # max_batch_size 8: an eighth of it
    ("preferred_batch_size: [ 2 ]", OVERLAP % 5, 5),
])
def test_launch_overlap_rows_defaults_to_the_smallest_preferred_batch_size(batching: str, parameters: str,
                                                                           expected: int) -> None:
    loaded, _ = model(batching, parameters)
    assert overlap_rows(loaded, BatchingPolicy.from_config(loaded.spec.config)) == expected
    spec = validate_config(parse_config_text(CONFIG.replace("max_batch_size: 8", "max_batch_size: 64")
                                             % ("", "")), "m", "config.pbtxt", None)
    big = LoadedModel(spec, 1, Path("."), [SlotEngine(spec)])
    assert overlap_rows(big, BatchingPolicy.from_config(spec.config)) == 8


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_a_bad_launch_overlap_rows_is_named_when_the_model_loads(value: str) -> None:
    loaded, _ = model(parameters=OVERLAP % value)
    with pytest.raises(InvalidArgumentError, match=f"model 'm': parameter 'launch_overlap_rows' is '{value}'; "
                                                   f"expected a whole number of rows, 1 or more"):
        DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config))


async def test_without_dynamic_batching_each_request_is_launched_alone_one_per_instance_at_a_time() -> None:
    text = CONFIG.replace("dynamic_batching { %s }\n%s\n", "instance_group [ { count: 2 kind: KIND_CPU } ]")
    spec = validate_config(parse_config_text(text), "m", "config.pbtxt", None)
    engines = [SlotEngine(spec, slots=4, device_s=0.02) for _ in range(2)]
    loaded = LoadedModel(spec, 1, Path("."), list(engines))
    scheduler = DirectScheduler(loaded)
    try:
        responses = await asyncio.gather(*(scheduler.submit(request(float(i)), 1) for i in range(6)))
    finally:
        await asyncio.to_thread(scheduler.close)
    assert [float(r.outputs[0].data[0, 0]) for r in responses] == [float(i + 1) for i in range(6)]
    assert engines[0].batches == [1, 1, 1] and engines[1].batches == [1, 1, 1]
    assert all(engine.most_out == 1 and engine.executed == 0 for engine in engines)
    assert engines[0].launch_threads == {threading.current_thread().name}


def test_one_batch_per_instance_holds_for_callers_on_several_event_loops() -> None:
    loaded, (engine,) = model(slots=4)
    engine.device_s, engine.launch_s = 0.005, 0.001  # each loop's launch gives the others time to try theirs
    batcher = DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config))

    def caller() -> None:
        async def requests() -> None:
            for i in range(30):
                await batcher.submit(request(float(i)), 1)

        asyncio.run(requests())

    callers = [threading.Thread(target=caller) for _ in range(3)]
    try:
        for thread in callers:
            thread.start()
        for thread in callers:
            thread.join(timeout=30)
    finally:
        batcher.close()
    assert sum(engine.batches) == 90 and engine.most_out == 1


def _launch_then_close_the_loop(batcher: DynamicBatcher, posted_first: bool) -> None:
    """A caller's loop launches a batch and closes (its caller cancelled) before the batch is collected: after
    the waiter handed the batch to the loop (posted_first) or before."""
    loop = asyncio.new_event_loop()
    task = loop.create_task(batcher.submit(request(1.0), 1))
    loop.run_until_complete(asyncio.sleep(0.005))  # launched, on the device
    task.cancel()
    loop.run_until_complete(asyncio.sleep(0))
    if posted_first:
        time.sleep(0.1)  # the device is done and the waiter posted the batch to the loop, which never runs it
    loop.close()


@pytest.mark.parametrize("posted_first", [True, False])
def test_a_batch_whose_event_loop_closed_does_not_hold_its_instance(posted_first: bool) -> None:
    loaded, (engine,) = model(slots=4)
    engine.device_s = 0.05
    batcher = DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config))
    try:
        _launch_then_close_the_loop(batcher, posted_first)

        async def later() -> float:
            response = await asyncio.wait_for(batcher.submit(request(2.0), 1), 5)
            return float(response.outputs[0].data[0, 0])

        assert asyncio.run(later()) == 3.0
    finally:
        batcher.close()
    assert engine.free == 4 and all(launched.collected for launched in engine.launched)
    assert loaded.stats.snapshot().fail.count == 1  # the abandoned request, counted as cancelled


async def test_requests_still_waiting_when_closing_times_out_are_answered() -> None:
    loaded, (engine,) = model(slots=4)
    engine.device_s = 1.0
    batcher = DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config))
    launcher = batcher._launcher
    first = asyncio.ensure_future(batcher.submit(request(1.0), 1))
    await asyncio.sleep(0.01)  # on the device for a second
    waiting = asyncio.ensure_future(batcher.submit(request(2.0), 1))  # waits for the instance
    await asyncio.sleep(0.01)
    closing = asyncio.ensure_future(asyncio.to_thread(launcher.close, 0.05))
    with pytest.raises(VersionUnloadingError):
        await asyncio.wait_for(waiting, 0.5)
    await closing
    assert float((await first).outputs[0].data[0, 0]) == 2.0


async def test_preferred_batch_sizes_cut_the_launched_batches() -> None:
    loaded, (engine,) = model(batching="preferred_batch_size: [ 2 ]", slots=8)
    batcher = DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config))
    try:
        await asyncio.gather(*(batcher.submit(request(float(i)), 1) for i in range(5)))
    finally:
        await asyncio.to_thread(batcher.close)
    assert engine.batches == [2, 2, 1]


async def test_a_launch_failure_fails_its_batch_only_and_the_next_batches_run() -> None:
    loaded, (engine,) = model()
    batcher = DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config))
    try:
        with pytest.raises(InternalError, match="negative input"):
            await batcher.submit(request(-1.0), 1)
        response = await batcher.submit(request(3.0), 1)
        engine.fail_on_device = True
        with pytest.raises(InternalError, match="the device failed"):
            await batcher.submit(request(3.0), 1)
        engine.fail_on_device = False
        again = await batcher.submit(request(4.0), 1)
    finally:
        await asyncio.to_thread(batcher.close)
    assert float(response.outputs[0].data[0, 0]) == 4.0 and float(again.outputs[0].data[0, 0]) == 5.0
    assert engine.free == 2 and all(launched.collected for launched in engine.launched)
    assert loaded.stats.snapshot().fail.count == 2


async def test_requests_retry_while_another_caller_holds_every_slot() -> None:
    """A blocking caller (or a draining scheduler) can hold the engine's slots with none of this runner's batches
    out, so no finished batch would wake the waiting requests: they retry on their own."""
    loaded, (engine,) = model(slots=1)
    engine.free = 0  # held elsewhere
    batcher = DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config))
    try:
        waiting = asyncio.ensure_future(batcher.submit(request(1.0), 1))
        await asyncio.sleep(0.02)
        assert not waiting.done() and not engine.batches
        with engine.lock:
            engine.free = 1  # given back by a thread this runner knows nothing of
        response = await asyncio.wait_for(waiting, 5)
    finally:
        await asyncio.to_thread(batcher.close)
    assert float(response.outputs[0].data[0, 0]) == 2.0 and engine.batches == [1]


async def test_a_failing_request_observer_neither_loses_answers_nor_stops_the_runner() -> None:
    def observer(times: object) -> None:
        raise RuntimeError("observer broke")

    loaded, (engine,) = model()
    loaded.stats.observers.append(observer)
    batcher = DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config))
    try:
        first = await asyncio.wait_for(batcher.submit(request(1.0), 1), 5)
        second = await asyncio.wait_for(batcher.submit(request(2.0), 1), 5)
    finally:
        await asyncio.to_thread(batcher.close)
    assert [float(r.outputs[0].data[0, 0]) for r in (first, second)] == [2.0, 3.0]


async def test_bad_request_parameters_are_refused_as_on_the_worker_path() -> None:
    loaded, (engine,) = model()
    batcher = DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config))
    bad = request(1.0)
    bad.parameters["priority"] = "high"
    try:
        with pytest.raises(InvalidArgumentError, match="priority"):
            await batcher.submit(bad, 1)
    finally:
        await asyncio.to_thread(batcher.close)
    assert not engine.batches


async def test_blocking_callers_still_take_the_worker_path() -> None:
    loaded, (engine,) = model()
    batcher = DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config))
    try:
        response = await asyncio.to_thread(batcher.submit_sync, request(1.0), 1)
    finally:
        await asyncio.to_thread(batcher.close)
    assert float(response.outputs[0].data[0, 0]) == 2.0 and engine.executed == 1 and not engine.batches


async def test_closing_answers_the_launched_requests_then_refuses_new_ones() -> None:
    loaded, (engine,) = model()
    engine.device_s = 0.05
    batcher = DynamicBatcher(loaded, BatchingPolicy.from_config(loaded.spec.config))
    running = asyncio.ensure_future(batcher.submit(request(1.0), 1))
    await asyncio.sleep(0)  # launched, on the device
    closing = asyncio.ensure_future(asyncio.to_thread(batcher.close))
    assert float((await running).outputs[0].data[0, 0]) == 2.0
    await closing
    with pytest.raises(VersionUnloadingError):
        await batcher.submit(request(1.0), 1)


@pytest.mark.parametrize(("batching", "parameters", "expected"), [
    ("", "", "auto"),
    ("preferred_batch_size: [ 4 ]", "", "auto"),
    ("max_queue_delay_microseconds: 100", "", "off"),
    ("priority_levels: 2 default_priority_level: 1", "", "off"),
    ("preserve_ordering: true", "", "off"),
    ("default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 10 }", "", "off"),
    ("", 'parameters { key: "launch_execution" value { string_value: "off" } }', "off"),
])
def test_launching_needs_no_queue_rules_and_can_be_turned_off(batching: str, parameters: str, expected: str) -> None:
    loaded, _ = model(batching, parameters)
    assert launch_mode(loaded, BatchingPolicy.from_config(loaded.spec.config)) == expected


def test_engines_that_cannot_launch_are_never_launched_and_bad_values_are_named() -> None:
    loaded, (engine,) = model()
    engine.launches = False
    assert launch_mode(loaded, BatchingPolicy.from_config(loaded.spec.config)) == "off"
    loaded, _ = model(parameters='parameters { key: "launch_execution" value { string_value: "sometimes" } }')
    with pytest.raises(InvalidArgumentError, match="'launch_execution' is 'sometimes'; expected auto or off"):
        launch_mode(loaded, BatchingPolicy.from_config(loaded.spec.config))


def test_a_server_launches_for_callers_on_several_event_loops_sharing_one_slot(tmp_path: Path) -> None:
    """Two threads, each with its own event loop, share one device slot: a batch finishing on one loop must wake
    the requests waiting on the other."""
    from kiln.engines import EngineOptions, register_backend
    from kiln.server import Server, ServerOptions

    made: list[SlotEngine] = []

    def factory(spec: object, model_file: Path, options: EngineOptions) -> SlotEngine:
        engine = SlotEngine(spec, slots=1, device_s=0.002)
        made.append(engine)
        return engine

    register_backend("kiln_test_launching", factory)
    folder = tmp_path / "repo" / "m"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text((CONFIG % ("", "")).replace('"identity"', '"kiln_test_launching"'))
    server = Server(ServerOptions(repositories=[tmp_path / "repo"]))
    assert not server.start()
    answers: dict[int, list[float]] = {}

    def caller(index: int) -> None:
        async def send() -> list[float]:
            responses = await asyncio.gather(*(server.infer(request(100.0 * index + i)) for i in range(12)))
            return [float(r.outputs[0].data[0, 0]) for r in responses]

        answers[index] = asyncio.run(send())

    try:
        threads = [threading.Thread(target=caller, args=(index,)) for index in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        stats = server.model_statistics("m")[0]
    finally:
        server.close()
    assert answers == {index: [100.0 * index + i + 1 for i in range(12)] for index in range(2)}
    (engine,) = made
    assert sum(engine.batches) == 24 and engine.executed == 0 and len(engine.launch_threads) == 2
    assert stats.inference_count == 24 and engine.free == 1
