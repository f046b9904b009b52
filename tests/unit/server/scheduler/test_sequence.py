"""The sequence batcher: slot assignment and batch formation on a fake clock, control values, implicit state, and
the threaded batcher over a recording engine."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.config import parse_config_text
from kiln.config.validate import validate_config
from kiln.engines.base import Array, Engine
from kiln.errors import InternalError, InvalidArgumentError, UnavailableError, UnsupportedError
from kiln.server.model import LoadedModel
from kiln.server.scheduler import make_scheduler
from kiln.server.scheduler.sequence import Pending, Round, SequenceBatcher, SequencePolicy, SequenceTable
from kiln.server.scheduler.sequence_controls import (
    PADDING,
    RowControl,
    SequenceControls,
    SequenceParams,
    sequence_params,
)
from kiln.server.scheduler.sequence_state import StateSpec, split_states, stack_states
from kiln.tensor import DataType
from kiln.v2.types import InferRequest, InputTensor

IDLE_NS = 1_000


def direct(slots: int = 2, **overrides: Any) -> SequencePolicy:
    return SequencePolicy(oldest=False, slots_per_instance=slots, max_rows=slots, idle_ns=IDLE_NS, **overrides)


def oldest(candidates: int = 4, rows: int = 2, **overrides: Any) -> SequencePolicy:
    return SequencePolicy(oldest=True, slots_per_instance=candidates, max_rows=rows, idle_ns=IDLE_NS, **overrides)


def pending(sid: int | str, start: bool = False, end: bool = False, t: int = 0, width: int = 1) -> Pending:
    data = np.zeros((1, width), np.float32)
    request = InferRequest("m", [InputTensor("x", DataType.FP32, data.shape, data)], id=f"{sid}@{t}")
    return Pending(request, SequenceParams(sid, start, end), ("x", width), t)


def ids(batch: Round) -> list[str | None]:
    """The request ids of a batch's rows; None for padding."""
    return [row.pending.request.id if row.pending is not None else None for row in batch.rows]


def finish(table: SequenceTable, batch: Round, t: int = 0) -> None:
    table.complete(batch, None, t)


# -- slots and the backlog ------------------------------------------------------------------------------------


def test_new_sequences_take_the_lowest_free_slot_across_instances_then_wait_in_the_backlog() -> None:
    table = SequenceTable("m", direct(slots=2), instances=2)
    for sid in (1, 2, 3, 4, 5):
        table.admit(pending(sid, start=True), 0)
    assert [table.slot_of(sid) for sid in (1, 2, 3, 4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert table.slot_of(5) is None and table.backlog() == [5]


def test_end_frees_the_slot_for_the_oldest_backlogged_sequence() -> None:
    table = SequenceTable("m", direct(slots=1), instances=1)
    table.admit(pending("a", start=True, t=1), 1)
    table.admit(pending("b", start=True, t=2), 2)
    table.admit(pending("c", start=True, end=True, t=3), 3)
    assert table.backlog() == ["b", "c"]
    first = table.next_round(0, 4)
    assert ids(first) == ["a@1"]
    finish(table, first)
    table.admit(pending("a", end=True, t=5), 5)
    last = table.next_round(0, 6)
    assert ids(last) == ["a@5"]
    assert table.next_round(0, 6).rows == []  # b may not run before a's END has run
    finish(table, last, 7)
    assert table.slot_of("a") is None and table.slot_of("b") == (0, 0) and table.backlog() == ["c"]
    assert ids(table.next_round(0, 8)) == ["b@2"]


def test_requests_of_one_sequence_run_one_at_a_time_in_arrival_order() -> None:
    table = SequenceTable("m", direct(slots=2), instances=1)
    for t in (1, 2, 3):
        table.admit(pending(7, start=t == 1, t=t), t)
    order: list[str | None] = []
    for t in (4, 5, 6):
        batch = table.next_round(0, t)
        assert table.next_round(0, t).rows == []  # the next one waits until this one is done
        order += ids(batch)
        finish(table, batch, t)
    assert order == ["7@1", "7@2", "7@3"]
    assert table.drained


def test_a_request_for_an_unknown_sequence_must_start_it() -> None:
    table = SequenceTable("acc", direct(), instances=1)
    with pytest.raises(InvalidArgumentError) as caught:
        table.admit(pending(42), 0)
    message = str(caught.value)
    assert message.startswith("inference request for sequence 42 to model 'acc' must specify the START flag")
    assert "'sequence_start'" in message and "max_sequence_idle_microseconds=1" in message


def test_a_start_for_an_active_sequence_restarts_it_in_the_same_slot(caplog: pytest.LogCaptureFixture) -> None:
    table = SequenceTable("m", direct(slots=2), instances=1)
    table.admit(pending(1, start=True, t=1), 1)
    with caplog.at_level(logging.WARNING, logger="kiln.server"):
        table.admit(pending(1, start=True, t=2), 2)
    assert "has a conflict" in caplog.text
    first = table.next_round(0, 3)
    finish(table, first)
    second = table.next_round(0, 4)
    assert ids(second) == ["1@2"] and second.rows[0].slot == 0 and second.rows[0].control.start


def test_after_end_the_same_id_starts_a_new_sequence() -> None:
    table = SequenceTable("m", direct(slots=2), instances=1)
    table.admit(pending(1, start=True, end=True, t=1), 1)
    table.admit(pending(1, start=True, t=2), 2)  # the first has not run yet: the new one gets its own slot
    assert table.slot_of(1) == (0, 1)
    assert ids(table.next_round(0, 3)) == ["1@1", "1@2"]


# -- idle sequences ------------------------------------------------------------------------------------------


def test_idle_sequences_are_released_and_their_next_request_fails() -> None:
    table = SequenceTable("m", direct(slots=1), instances=1)
    table.admit(pending(1, start=True, t=0), 0)
    table.admit(pending(2, start=True, t=0), 0)
    batch = table.next_round(0, 10)
    finish(table, batch, 10)
    assert table.next_idle_at() == 10 + IDLE_NS
    assert table.reap(10 + IDLE_NS - 1) == []
    assert table.reap(10 + IDLE_NS) == [1]
    assert table.slot_of(2) == (0, 0)  # the backlogged sequence got the freed slot
    with pytest.raises(InvalidArgumentError, match="sequence 1 .* not active"):
        table.admit(pending(1, t=2000), 2000)


def test_waiting_or_running_sequences_are_never_idle() -> None:
    table = SequenceTable("m", direct(slots=1), instances=1)
    table.admit(pending(1, start=True, t=0), 0)
    assert table.reap(5 * IDLE_NS) == [] and table.next_idle_at() is None  # queued
    batch = table.next_round(0, 5 * IDLE_NS)
    assert table.reap(10 * IDLE_NS) == []  # running
    finish(table, batch, 10 * IDLE_NS)
    assert table.reap(10 * IDLE_NS, closing=True) == [1]  # closing: idle ones go at once


# -- direct batches ------------------------------------------------------------------------------------------


def test_direct_pads_empty_lower_slots_with_not_ready_rows() -> None:
    table = SequenceTable("m", direct(slots=4), instances=1)
    for sid in "abc":
        table.admit(pending(sid, start=True), 0)
    finish(table, table.next_round(0, 1))
    table.admit(pending("c", t=2), 2)
    batch = table.next_round(0, 3)
    assert ids(batch) == [None, None, "c@2"]  # up to the highest slot with a request, not all four
    assert [row.control for row in batch.rows][:2] == [PADDING, PADDING]
    assert batch.rows[2].control == RowControl(ready=True, sequence_id="c")


def test_direct_defers_a_row_whose_shapes_differ_and_pads_its_slot() -> None:
    table = SequenceTable("m", direct(slots=2), instances=1)
    table.admit(pending("a", start=True, width=1), 0)
    table.admit(pending("b", start=True, width=3), 0)
    first = table.next_round(0, 1)
    assert ids(first) == ["a@0"]
    finish(table, first)
    assert ids(table.next_round(0, 2)) == [None, "b@0"]


def test_direct_lets_the_oldest_request_set_the_shapes() -> None:
    table = SequenceTable("m", direct(slots=2), instances=1)
    table.admit(pending("a", start=True, t=5, width=1), 5)
    table.admit(pending("b", start=True, t=1, width=3), 1)
    assert ids(table.next_round(0, 6)) == [None, "b@1"]


def test_direct_waits_for_slot_utilization_up_to_the_queue_delay() -> None:
    table = SequenceTable("m", direct(slots=4, max_queue_delay_ns=100, minimum_slot_utilization=0.5),
                          instances=1)
    table.admit(pending("a", start=True, t=0), 0)
    waiting = table.next_round(0, 10)
    assert waiting.rows == [] and waiting.wake_at_ns == 100
    assert ids(table.next_round(0, 100)) == ["a@0"]  # the delay ran out
    table.admit(pending("b", start=True, t=110), 110)
    table.admit(pending("c", start=True, t=111), 111)
    assert ids(table.next_round(0, 112)) == [None, "b@110", "c@111"]  # 2 of 4 slots ready: utilization 0.5


# -- oldest batches ------------------------------------------------------------------------------------------


def test_oldest_batches_the_oldest_sequences_one_request_each() -> None:
    table = SequenceTable("m", oldest(candidates=4, rows=2), instances=1)
    for t, sid in enumerate("abc"):
        table.admit(pending(sid, start=True, t=t), t)
    table.admit(pending("a", t=3), 3)
    first = table.next_round(0, 4)
    assert ids(first) == ["a@0", "b@1"]
    assert ids(table.next_round(0, 4)) == ["c@2"]  # a's second request waits for its first
    finish(table, first, 5)
    assert ids(table.next_round(0, 6)) == ["a@3"]


def test_oldest_waits_for_a_full_batch_up_to_the_queue_delay() -> None:
    table = SequenceTable("m", oldest(rows=4, max_queue_delay_ns=100), instances=1)
    table.admit(pending("a", start=True, t=0), 0)
    table.admit(pending("b", start=True, t=20), 20)
    waiting = table.next_round(0, 50)
    assert waiting.rows == [] and waiting.wake_at_ns == 100
    assert ids(table.next_round(0, 100)) == ["a@0", "b@20"]


def test_oldest_sends_a_preferred_batch_size_at_once() -> None:
    table = SequenceTable("m", oldest(rows=4, max_queue_delay_ns=100, preferred_batch_sizes=(2,)), instances=1)
    for t, sid in enumerate("abc"):
        table.admit(pending(sid, start=True, t=t), t)
    assert ids(table.next_round(0, 3)) == ["a@0", "b@1"]


def test_oldest_cuts_the_batch_at_a_shape_change() -> None:
    table = SequenceTable("m", oldest(rows=4, max_queue_delay_ns=100), instances=1)
    table.admit(pending("a", start=True, t=0, width=1), 0)
    table.admit(pending("b", start=True, t=1, width=2), 1)
    table.admit(pending("c", start=True, t=2, width=1), 2)
    assert ids(table.next_round(0, 3)) == ["a@0"]  # cannot grow past b, so it goes now
    assert ids(table.next_round(0, 3)) == ["b@1"]


def test_oldest_candidates_bound_the_sequences_per_instance() -> None:
    table = SequenceTable("m", oldest(candidates=1, rows=4), instances=2)
    for sid in (1, 2, 3):
        table.admit(pending(sid, start=True), 0)
    assert (table.slot_of(1), table.slot_of(2), table.backlog()) == ((0, 0), (1, 0), [3])


# -- implicit state ------------------------------------------------------------------------------------------


STATE = StateSpec("S_IN", "S_OUT", DataType.INT32, (1,), np.array([5], np.int32))


def test_state_starts_from_the_initial_value_and_carries_over() -> None:
    table = SequenceTable("m", direct(slots=2), instances=1, states=[STATE])
    table.admit(pending(1, start=True), 0)
    first = table.next_round(0, 1)
    assert first.rows[0].state is not None and first.rows[0].state["S_IN"].tolist() == [5]
    table.complete(first, [{"S_IN": np.array([9], np.int32)}], 2)
    table.admit(pending(1), 3)
    table.admit(pending(1, start=True), 3)  # a restart
    second = table.next_round(0, 4)
    assert second.rows[0].state is not None and second.rows[0].state["S_IN"].tolist() == [9]
    table.complete(second, None, 5)  # a failed execution keeps the state
    third = table.next_round(0, 6)
    assert third.rows[0].state is not None and third.rows[0].state["S_IN"].tolist() == [5]


def test_state_tensors_stack_with_zero_padding_and_split_per_row() -> None:
    rows = [None, {"S_IN": np.array([3], np.int32)}]
    stacked = stack_states([STATE], rows, batching=True)
    assert stacked["S_IN"].tolist() == [[0], [3]]
    assert stack_states([STATE], rows[1:], batching=False)["S_IN"].tolist() == [3]
    split = split_states([STATE], {"S_OUT": np.array([[1], [2]], np.int32)}, 2, batching=True)
    assert [s["S_IN"].tolist() for s in split] == [[1], [2]]


# -- parameters and controls -----------------------------------------------------------------------------------


def _request(**parameters: Any) -> InferRequest:
    return InferRequest("acc", [], parameters=parameters)


@pytest.mark.parametrize(("parameters", "fragment"), [
    ({}, "must specify a non-zero or non-empty correlation ID: request parameter 'sequence_id' is missing"),
    ({"sequence_id": 0}, "'sequence_id' is 0"),
    ({"sequence_id": ""}, "'sequence_id' is ''"),
    ({"sequence_id": True}, "'sequence_id' is True; expected a non-zero unsigned 64-bit integer"),
    ({"sequence_id": -3}, "'sequence_id' is -3; expected 1..18446744073709551615"),
    ({"sequence_id": 2**64}, "expected 1..18446744073709551615"),
    ({"sequence_id": 1.5}, "'sequence_id' is 1.5"),
    ({"sequence_id": 1, "sequence_start": 1}, "'sequence_start' is 1; expected true or false"),
    ({"sequence_id": 1, "sequence_end": "yes"}, "'sequence_end' is 'yes'; expected true or false"),
])
def test_bad_sequence_parameters_are_named(parameters: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidArgumentError, match="acc") as caught:
        sequence_params("acc", _request(**parameters))
    assert fragment in str(caught.value)


def test_sequence_parameters_accept_integers_and_strings() -> None:
    assert sequence_params("m", _request(sequence_id=2**64 - 1, sequence_start=True)) == \
        SequenceParams(2**64 - 1, True, False)
    assert sequence_params("m", _request(sequence_id="s-1", sequence_end=True)) == SequenceParams("s-1", False, True)


CONTROLS = """
name: "m" backend: "identity" max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
sequence_batching {
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END fp32_false_true: [ -1, 2.5 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: %s } ] }
  ]
}
"""


def test_control_tensors_hold_each_rows_values_in_the_configured_types() -> None:
    controls = SequenceControls.from_config(parse_config_text(CONTROLS % "TYPE_UINT32").sequence_batching)
    rows = [RowControl(True, start=True, sequence_id=7), PADDING, RowControl(True, end=True, sequence_id=9)]
    tensors = controls.tensors(rows, batching=True)
    assert tensors["START"].dtype == np.int32 and tensors["START"].tolist() == [[1], [0], [0]]
    assert tensors["END"].dtype == np.float32 and tensors["END"].tolist() == [[-1.0], [-1.0], [2.5]]
    assert tensors["READY"].dtype == np.bool_ and tensors["READY"].tolist() == [[True], [False], [True]]
    assert tensors["CORRID"].dtype == np.uint32 and tensors["CORRID"].tolist() == [[7], [0], [9]]
    single = controls.tensors(rows[:1], batching=False)
    assert {name: t.shape for name, t in single.items()} == {n: (1,) for n in ("START", "END", "READY", "CORRID")}


def test_corrid_type_limits_the_sequence_ids() -> None:
    numeric = SequenceControls.from_config(parse_config_text(CONTROLS % "TYPE_UINT32").sequence_batching)
    with pytest.raises(InvalidArgumentError, match="string 'abc'.*TYPE_UINT32; send an integer sequence_id"):
        numeric.check("m", SequenceParams("abc", True, False))
    with pytest.raises(InvalidArgumentError, match="does not fit the CORRID control input 'CORRID'"):
        numeric.check("m", SequenceParams(2**32, True, False))
    strings = SequenceControls.from_config(parse_config_text(CONTROLS % "TYPE_STRING").sequence_batching)
    strings.check("m", SequenceParams("abc", True, False))
    assert strings.tensors([RowControl(True, sequence_id="abc"), RowControl(True, sequence_id=3), PADDING],
                           batching=True)["CORRID"].tolist() == [[b"abc"], [b"3"], [b""]]


def test_policy_from_config_uses_tritons_defaults() -> None:
    plain = SequencePolicy.from_config(parse_config_text("max_batch_size: 3 sequence_batching { }"))
    assert (plain.oldest, plain.slots_per_instance, plain.max_rows, plain.idle_ns) == (False, 3, 3, 1_000_000_000)
    unbatched = SequencePolicy.from_config(parse_config_text("sequence_batching { direct { } }"))
    assert (unbatched.slots_per_instance, unbatched.max_rows) == (1, 1)
    old = SequencePolicy.from_config(parse_config_text(
        "max_batch_size: 2 sequence_batching { max_sequence_idle_microseconds: 7 oldest { max_candidate_sequences: 5 "
        "preferred_batch_size: [ 2, 1, 2 ] max_queue_delay_microseconds: 3 } }"))
    assert (old.oldest, old.slots_per_instance, old.max_rows, old.idle_ns) == (True, 5, 2, 7000)
    assert (old.preferred_batch_sizes, old.max_queue_delay_ns) == ((1, 2), 3000)


# -- the threaded batcher --------------------------------------------------------------------------------------


MODEL = """
name: "acc" backend: "identity" max_batch_size: 2
input [ { name: "x" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "S_OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching {
  %s
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }
  ]
  state [ { input_name: "S_IN" output_name: "S_OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
}
"""


class Accumulator(Engine):
    """y = S_OUT = x + (0 on START else S_IN); records every feed; a gate lets tests hold a batch."""

    def __init__(self, spec: Any, fail_on: int | None = None) -> None:
        super().__init__(spec)
        self.feeds: list[dict[str, list[Any]]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.fail_on = fail_on

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        self.started.set()
        self.gate.wait(10)
        self.feeds.append({name: value.tolist() for name, value in inputs.items()})
        if self.fail_on is not None and (inputs["x"] == self.fail_on).any():
            raise RuntimeError("engine exploded")
        total = inputs["x"] + np.where(inputs["START"] == 1, 0, inputs["S_IN"])
        return {name: total for name in outputs}


def make(strategy: str = "direct { }", engines: int = 1, **engine_args: Any) -> tuple[SequenceBatcher,
                                                                                      list[Accumulator]]:
    config = parse_config_text(MODEL % strategy)
    spec = validate_config(config, "acc", "config.pbtxt", None)
    instances = [Accumulator(spec, **engine_args) for _ in range(engines)]
    model = LoadedModel(spec, 1, Path("."), list(instances))
    return SequenceBatcher(model), instances


def step(sid: int | str, value: int, start: bool = False, end: bool = False) -> InferRequest:
    data = np.array([[value]], np.int32)
    return InferRequest("acc", [InputTensor("x", DataType.INT32, data.shape, data)], id=f"{sid}:{value}",
                        parameters={"sequence_id": sid, "sequence_start": start, "sequence_end": end})


async def test_batcher_accumulates_two_interleaved_sequences_with_controls_and_state() -> None:
    batcher, (engine,) = make()
    sums: dict[str, list[int]] = {"a": [], "b": []}
    plan = [("a", 1, True, False), ("b", 10, True, False), ("a", 2, False, False), ("b", 20, False, False),
            ("a", 3, False, True), ("b", 30, False, True)]
    for sid, value, start, end in plan:
        response = await batcher.submit(step(sid, value, start, end), 1)
        sums[sid].append(int(response.outputs[0].data[0, 0]))
    assert sums == {"a": [1, 3, 6], "b": [10, 30, 60]}
    assert engine.feeds[1] == {"x": [[0], [10]], "START": [[0], [1]], "READY": [[0], [1]], "S_IN": [[0], [0]]}
    stats = batcher.model.stats.snapshot()
    assert (stats.inference_count, stats.execution_count) == (6, 6)  # padding rows are not inferences
    batcher.close()


async def test_batcher_forms_a_full_direct_batch_when_both_slots_wait() -> None:
    batcher, (engine,) = make()
    await batcher.submit(step(1, 1, start=True), 1)
    await batcher.submit(step(2, 5, start=True), 1)
    engine.started.clear()
    engine.gate.clear()
    first = asyncio.ensure_future(batcher.submit(step(1, 1), 1))
    await asyncio.to_thread(engine.started.wait, 5)
    later = [asyncio.ensure_future(batcher.submit(step(sid, value), 1)) for sid, value in ((1, 10), (2, 1))]
    backlogged = asyncio.ensure_future(batcher.submit(step(3, 100, start=True, end=True), 1))
    await asyncio.sleep(0.05)
    engine.gate.set()
    answers = [int(r.outputs[0].data[0, 0]) for r in await asyncio.gather(first, *later)]
    assert answers == [2, 12, 6]
    assert engine.feeds[-1]["x"] == [[10], [1]] and engine.feeds[-1]["READY"] == [[1], [1]]
    assert not backlogged.done()  # both slots are still held
    batcher.close()  # idle sequences give up their slots, so the backlogged one runs before the engines close
    assert int((await backlogged).outputs[0].data[0, 0]) == 100


async def test_batcher_answers_a_failed_batch_with_the_error_and_lives_on() -> None:
    batcher, _ = make(fail_on=13)
    await batcher.submit(step(1, 1, start=True), 1)
    with pytest.raises(InternalError, match="engine exploded"):
        await batcher.submit(step(1, 13), 1)
    response = await batcher.submit(step(1, 2, end=True), 1)
    assert int(response.outputs[0].data[0, 0]) == 3  # the failed request did not change the state
    assert batcher.model.stats.snapshot().fail.count == 1
    batcher.close()


def test_batcher_rejects_bad_requests_before_queueing() -> None:
    batcher, _ = make()
    with pytest.raises(InvalidArgumentError, match="must specify batch-size 1 due to requirements of sequence"):
        batcher.submit_sync(step(1, 1, start=True), 2)
    with pytest.raises(InvalidArgumentError, match="must specify the START flag"):
        batcher.submit_sync(step(1, 1), 1)
    assert batcher.inflight == 0
    batcher.close()
    with pytest.raises(UnavailableError, match="unloading"):
        batcher.submit_sync(step(1, 1, start=True), 1)


def test_oldest_batcher_runs_sequences_on_several_instances() -> None:
    batcher, engines = make("oldest { max_candidate_sequences: 2 }", engines=2)
    for sid in range(1, 5):
        assert int(batcher.submit_sync(step(sid, sid, start=True), 1).outputs[0].data[0, 0]) == sid
    for sid in range(1, 5):
        assert int(batcher.submit_sync(step(sid, 1, end=True), 1).outputs[0].data[0, 0]) == sid + 1
    assert all(engine.feeds for engine in engines)
    batcher.close()


def test_make_scheduler_builds_the_sequence_batcher_and_refuses_iterative_sequences() -> None:
    config = parse_config_text(MODEL % "direct { }")
    spec = validate_config(config, "acc", "config.pbtxt", None)
    scheduler = make_scheduler(LoadedModel(spec, 1, Path("."), [Accumulator(spec)]))
    assert isinstance(scheduler, SequenceBatcher)
    scheduler.close()
    config.sequence_batching.iterative_sequence = True
    with pytest.raises(UnsupportedError, match="iterative_sequence is not supported"):
        make_scheduler(LoadedModel(spec, 1, Path("."), [Accumulator(spec)]))
