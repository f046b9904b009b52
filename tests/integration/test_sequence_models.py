"""Stateful models over a real Server and onnxruntime: sequences of requests with control inputs and implicit state,
the config checks that sequence_batching needs, and sequence requests through the HTTP app and gRPC service."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import pytest
import tritonclient.grpc.aio as tc_aio
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from kiln.config import open_model_dir
from kiln.errors import ConfigError, InvalidArgumentError
from kiln.frontends.grpc import start_grpc_server
from kiln.frontends.http import build_app
from kiln.server import InferRequest, InputTensor, Server, ServerOptions
from kiln.tensor import DataType
from kiln.testing import IR_VERSION, OPSET, write_model

IDLE_US = 300_000


def _tensor(name: str, elem: int, batch: bool = True) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, ["batch", 1] if batch else [1])


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
           outputs: list[onnx.ValueInfoProto]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "sequence", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def accumulator(batch: bool = True, start_width: int = 1) -> onnx.ModelProto:
    """OUTPUT = OUTPUT_STATE = (INPUT + INPUT_STATE * (1 - START)) * READY: a running sum per sequence."""
    int32 = TensorProto.INT32
    one = helper.make_tensor("one", int32, [], [1])
    nodes = [
        helper.make_node("Constant", [], ["ONE"], value=one),
        helper.make_node("Sub", ["ONE", "START"], ["KEEP"]),
        helper.make_node("Mul", ["INPUT_STATE", "KEEP"], ["PREVIOUS"]),
        helper.make_node("Add", ["INPUT", "PREVIOUS"], ["SUM"]),
        helper.make_node("Mul", ["SUM", "READY"], ["TOTAL"]),
        helper.make_node("Identity", ["TOTAL"], ["OUTPUT"]),
        helper.make_node("Identity", ["TOTAL"], ["OUTPUT_STATE"]),
    ]
    inputs = [_tensor(n, int32, batch) for n in ("INPUT", "START", "READY", "INPUT_STATE")]
    if start_width != 1:
        inputs[1] = helper.make_tensor_value_info("START", int32, ["batch", start_width])
    return _model(nodes, inputs, [_tensor("OUTPUT", int32, batch), _tensor("OUTPUT_STATE", int32, batch)])


def echo() -> onnx.ModelProto:
    """CORRID_OUT = CORRID; FLAGS = 2 * START + END; OUTPUT = INPUT: shows what the server fed each row."""
    fp32 = TensorProto.FLOAT
    two = helper.make_tensor("two", fp32, [], [2.0])
    nodes = [
        helper.make_node("Identity", ["CORRID"], ["CORRID_OUT"]),
        helper.make_node("Constant", [], ["TWO"], value=two),
        helper.make_node("Mul", ["START", "TWO"], ["START2"]),
        helper.make_node("Add", ["START2", "END"], ["FLAGS"]),
        helper.make_node("Identity", ["INPUT"], ["OUTPUT"]),
    ]
    inputs = [_tensor("INPUT", fp32), _tensor("START", fp32), _tensor("END", fp32),
              _tensor("CORRID", TensorProto.UINT64)]
    outputs = [_tensor("OUTPUT", fp32), _tensor("FLAGS", fp32), _tensor("CORRID_OUT", TensorProto.UINT64)]
    return _model(nodes, inputs, outputs)


CONTROLS = """
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }
  ]
"""
STATE = """
  state [ { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 1 ]
            initial_state { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "zero" } } ]
"""
ACCUMULATE = f"""max_batch_size: 2
sequence_batching {{
  max_sequence_idle_microseconds: {IDLE_US}
  direct {{ }}
  {CONTROLS}
  {STATE}
}}
"""
UNBATCHED = f"max_batch_size: 0\nsequence_batching {{ {CONTROLS} {STATE} }}\n"
ECHO = """max_batch_size: 4
instance_group [ { count: 2 kind: KIND_CPU } ]
sequence_batching {
  oldest { max_candidate_sequences: 3 }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("repo")
    write_model(root, "accumulate", accumulator(), ACCUMULATE)
    write_model(root, "unbatched", accumulator(batch=False), UNBATCHED)
    write_model(root, "echo", echo(), ECHO)
    instance = Server(ServerOptions(repositories=[root]))
    instance.start()
    yield instance
    instance.close()


def step(model: str, sid: int | str, value: int, start: bool = False, end: bool = False,
         batch: bool = True) -> InferRequest:
    data = np.array([[value]] if batch else [value], np.int32)
    return InferRequest(model, [InputTensor("INPUT", DataType.INT32, data.shape, data)],
                        parameters={"sequence_id": sid, "sequence_start": start, "sequence_end": end})


def total(response: Any) -> int:
    return int(response.outputs[0].data.reshape(-1)[0])


# -- the accumulator -----------------------------------------------------------------------------------------


async def test_two_interleaved_sequences_keep_separate_running_sums(server: Server) -> None:
    plan = [("a", 1, True, False), ("b", 100, True, False), ("a", 2, False, False), ("b", 200, False, False),
            ("a", 3, False, True), ("b", 300, False, True)]
    sums: dict[str, list[int]] = {"a": [], "b": []}
    for sid, value, start, end in plan:
        sums[sid].append(total(await server.infer(step("accumulate", sid, value, start, end))))
    assert sums == {"a": [1, 3, 6], "b": [100, 300, 600]}


async def test_concurrent_sequences_share_batches_without_mixing_state(server: Server) -> None:
    async def run(sid: int) -> list[int]:
        results = [total(await server.infer(step("accumulate", sid, sid, start=True)))]
        for index in range(1, 4):
            results.append(total(await server.infer(step("accumulate", sid, sid, end=index == 3))))
        return results

    sequences = await asyncio.gather(*(run(sid) for sid in (1, 2, 3, 4)))  # 4 sequences, 2 slots: a backlog
    assert sequences == [[sid, 2 * sid, 3 * sid, 4 * sid] for sid in (1, 2, 3, 4)]
    stats = server.model_statistics("accumulate")[0]
    assert stats.inference_count >= 16 and stats.fail.count == 0


def test_blocking_infer_and_a_model_without_batching(server: Server) -> None:
    assert total(server.infer_sync(step("unbatched", "s", 5, start=True, batch=False))) == 5
    assert total(server.infer_sync(step("unbatched", "s", 6, end=True, batch=False))) == 11


def test_a_restart_resets_the_state(server: Server) -> None:
    assert total(server.infer_sync(step("accumulate", 9, 4, start=True))) == 4
    assert total(server.infer_sync(step("accumulate", 9, 4, start=True))) == 4
    assert total(server.infer_sync(step("accumulate", 9, 1, end=True))) == 5


def test_requests_outside_a_sequence_fail_clearly(server: Server) -> None:
    with pytest.raises(InvalidArgumentError, match="model 'accumulate' must specify a non-zero or non-empty "
                                                   "correlation ID: request parameter 'sequence_id' is missing"):
        server.infer_sync(InferRequest("accumulate", step("accumulate", 1, 1).inputs))
    with pytest.raises(InvalidArgumentError, match="sequence 77 to model 'accumulate' must specify the START flag"):
        server.infer_sync(step("accumulate", 77, 1))
    with pytest.raises(InvalidArgumentError, match="unexpected input 'START'"):
        request = step("accumulate", 5, 1, start=True)
        request.inputs.append(InputTensor("START", DataType.INT32, (1, 1), np.ones((1, 1), np.int32)))
        server.infer_sync(request)


def test_an_idle_sequence_is_released_and_cannot_continue(server: Server) -> None:
    server.infer_sync(step("accumulate", "idle", 1, start=True))
    deadline = time.monotonic() + 5
    while True:  # released once a worker wakes past the idle limit; allow a slow machine 5 s
        # Half the limit again as margin: a request sent just as the limit passes may still find the sequence
        # (the worker has not woken yet), continue it and restart its idle time.
        time.sleep(1.5 * IDLE_US / 1e6)
        try:
            server.infer_sync(step("accumulate", "idle", 1))
        except InvalidArgumentError as exc:
            assert f"max_sequence_idle_microseconds={IDLE_US}" in str(exc)
            return
        assert time.monotonic() < deadline, "the idle sequence was never released"


def test_config_lists_only_the_client_inputs(server: Server) -> None:
    metadata = server.model_metadata("accumulate")
    assert [t.name for t in metadata.inputs] == ["INPUT"]
    assert [t.name for t in metadata.outputs] == ["OUTPUT", "OUTPUT_STATE"]


# -- oldest, CORRID ------------------------------------------------------------------------------------------


async def test_oldest_feeds_each_row_its_correlation_id_and_flags(server: Server) -> None:
    async def send(sid: int, value: float, start: bool = False, end: bool = False) -> tuple[float, float, int]:
        data = np.array([[value]], np.float32)
        request = InferRequest("echo", [InputTensor("INPUT", DataType.FP32, data.shape, data)],
                               parameters={"sequence_id": sid, "sequence_start": start, "sequence_end": end})
        outputs = {o.name: o.data.reshape(-1)[0] for o in (await server.infer(request)).outputs}
        return float(outputs["OUTPUT"]), float(outputs["FLAGS"]), int(outputs["CORRID_OUT"])

    ids = [2**63 + 5, 11, 12, 13, 14, 15]  # 2 instances x 3 candidate sequences: no backlog
    starts = await asyncio.gather(*(send(sid, float(i), start=True) for i, sid in enumerate(ids)))
    assert starts == [(float(i), 2.0, sid) for i, sid in enumerate(ids)]
    middles = await asyncio.gather(*(send(sid, 0.5) for sid in ids))
    assert [m[1:] for m in middles] == [(0.0, sid) for sid in ids]
    ends = await asyncio.gather(*(send(sid, 1.0, end=True) for sid in ids))
    assert [e[1:] for e in ends] == [(1.0, sid) for sid in ids]


# -- config --------------------------------------------------------------------------------------------------


def test_auto_complete_leaves_out_control_and_state_inputs(tmp_path: Path) -> None:
    config = open_model_dir(write_model(tmp_path, "acc", accumulator(), ACCUMULATE)).spec.config
    assert [t.name for t in config.input] == ["INPUT"]
    assert [t.name for t in config.output] == ["OUTPUT", "OUTPUT_STATE"]
    assert config.WhichOneof("scheduling_choice") == "sequence_batching"
    unbatched = open_model_dir(write_model(tmp_path, "unbatched", accumulator(batch=False), UNBATCHED)).spec.config
    assert unbatched.max_batch_size == 0 and [t.name for t in unbatched.input] == ["INPUT"]
    assert unbatched.sequence_batching.max_sequence_idle_microseconds == 1_000_000  # Triton's default, shown


def _with(old: str, new: str, base: str = ACCUMULATE) -> str:
    assert old in base
    return base.replace(old, new)


BAD_CONFIGS = [
    ("control-listed-as-input", ACCUMULATE + 'input [ { name: "START" data_type: TYPE_INT32 dims: [ 1 ] } ]',
     "input 'START' is a sequence_batching control or state input, which the server fills; remove it"),
    ("control-not-in-file", _with('name: "READY"', 'name: "GO"'),
     "sequence_batching control input 'GO' is not an input of the model file (it has: INPUT, START, READY"),
    ("control-type", _with("READY\" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ]",
                           "READY\" control [ { kind: CONTROL_SEQUENCE_READY fp32_false_true: [ 0, 1 ]"),
     "control input 'READY' is TYPE_FP32 in the config, but the model file declares TYPE_INT32"),
    ("no-false-true", _with("kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ]",
                            "kind: CONTROL_SEQUENCE_START"),
     "control input 'START' (CONTROL_SEQUENCE_START) needs exactly one of int32_false_true, fp32_false_true or "
     "bool_false_true (it has none)"),
    ("two-false-true", _with("int32_false_true: [ 0, 1 ] } ] },", "int32_false_true: [ 0, 1 ] "
                             "bool_false_true: [ false, true ] } ] },"),
     "(it has int32_false_true and bool_false_true)"),
    ("three-values", _with("int32_false_true: [ 0, 1 ] } ] },", "int32_false_true: [ 0, 1, 2 ] } ] },"),
     "has int32_false_true [0, 1, 2]; give exactly two values"),
    ("twice-the-same-kind", _with("kind: CONTROL_SEQUENCE_READY", "kind: CONTROL_SEQUENCE_START"),
     "sequence_batching has two CONTROL_SEQUENCE_START controls ('START' and 'READY'); keep one"),
    ("corrid-type", _with('{ name: "READY"', '{ name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID '
                          'data_type: TYPE_FP32 } ] }, { name: "READY"'),
     "control input 'C' (CONTROL_SEQUENCE_CORRID) has data_type TYPE_FP32; expected one of TYPE_UINT64"),
    ("state-output-missing", _with('output_name: "OUTPUT_STATE"', 'output_name: "NEXT"'),
     "state output 'NEXT' is not an output of the model file"),
    ("state-dims", _with("dims: [ 1 ]\n            initial_state { data_type: TYPE_INT32 dims: [ 1 ]",
                         "dims: [ 2 ]\n            initial_state { data_type: TYPE_INT32 dims: [ 2 ]"),
     "state input 'INPUT_STATE' has shape [-1, 1] in the model file; expected [-1, 2]"),
    ("initial-state-dims", _with("dims: [ 1 ] zero_data", "dims: [ 3 ] zero_data"),
     "has initial_state dims [3], which do not fit the state dims [1]"),
    ("initial-state-type", _with("initial_state { data_type: TYPE_INT32", "initial_state { data_type: TYPE_FP32"),
     "has initial_state data_type TYPE_FP32 but the state is TYPE_INT32"),
    ("control-without-name", _with('{ name: "READY"', '{ name: ""'),
     "sequence_batching.control_input[1] has no name"),
    ("control-twice", _with('{ name: "READY"', '{ name: "START"'),
     "sequence_batching control input 'START' is listed twice"),
    ("two-controls-on-one-input", _with("int32_false_true: [ 0, 1 ] } ] },", "int32_false_true: [ 0, 1 ] }, "
                                        "{ kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },"),
     "control input 'START' has 2 controls; give exactly one control { kind: ... } per control input"),
    ("state-named-like-a-control", _with('input_name: "INPUT_STATE"', 'input_name: "READY"'),
     "'READY' is both a sequence_batching control input and a state input_name"),
    ("state-without-output", _with('output_name: "OUTPUT_STATE"', ""),
     "sequence_batching.state[0] needs input_name and output_name"),
    ("initial-state-without-data", _with("zero_data: true ", ""),
     "has an initial_state with neither zero_data nor data_file; set zero_data: true"),
    ("negative-candidates", _with("direct { }", "oldest { max_candidate_sequences: -1 }"),
     "sequence_batching.oldest.max_candidate_sequences is -1; expected 0 (= max_batch_size) or more"),
    ("slot-utilization", _with("direct { }", "direct { minimum_slot_utilization: 1.5 }"),
     "sequence_batching.direct.minimum_slot_utilization is 1.5; expected 0.0..1.0"),
    ("preferred-size", _with("direct { }", "oldest { preferred_batch_size: [ 3 ] }"),
     "sequence_batching.oldest.preferred_batch_size 3 is outside 1..max_batch_size (2)"),
]


@pytest.mark.parametrize(("config", "fragment"), [case[1:] for case in BAD_CONFIGS],
                         ids=[case[0] for case in BAD_CONFIGS])
def test_bad_sequence_configs_name_the_file_field_and_fix(tmp_path: Path, config: str, fragment: str) -> None:
    folder = write_model(tmp_path, "acc", accumulator(), config)
    with pytest.raises(ConfigError) as caught:
        open_model_dir(folder)
    assert str(caught.value).startswith(str(folder / "config.pbtxt") + ": ")
    assert fragment in str(caught.value)


def test_control_tensors_hold_one_value_per_row_in_the_model_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"control input 'START' has shape \[-1, 2\] in the model file; "
                                          r"expected \[-1, 1\]"):
        open_model_dir(write_model(tmp_path, "acc", accumulator(start_width=2), ACCUMULATE))


def test_state_output_must_be_declared_without_auto_complete(tmp_path: Path) -> None:
    config = ACCUMULATE + ('input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
                           'output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n')
    with pytest.raises(ConfigError, match="state output 'OUTPUT_STATE' is not listed in output; add it"):
        open_model_dir(write_model(tmp_path, "acc", accumulator(), config), autocomplete=False)


def test_initial_state_from_a_file(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "acc", accumulator(),
                         _with("zero_data: true", 'data_file: "ten"'))
    (folder / "initial_state").mkdir()
    (folder / "initial_state" / "ten").write_bytes(np.array([10], "<i4").tobytes())
    server = Server(ServerOptions(repositories=[tmp_path]))
    server.start()
    try:
        assert total(server.infer_sync(step("acc", 1, 1, start=True))) == 1  # START ignores the state
        assert total(server.infer_sync(step("acc", 1, 1, end=True))) == 2
    finally:
        server.close()
    (folder / "initial_state" / "ten").write_bytes(b"\x01")
    broken = Server(ServerOptions(repositories=[tmp_path]))
    broken.start()
    reason = broken.repository_index()[0].reason
    broken.close()
    assert "initial_state needs 4 bytes for TYPE_INT32 [1]" in reason


# -- frontends -----------------------------------------------------------------------------------------------


@pytest.fixture
async def http(server: Server) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(server))
    async with httpx.AsyncClient(transport=transport, base_url="http://kiln") as client:
        yield client


async def test_http_sequence_parameters(http: httpx.AsyncClient) -> None:
    def body(value: int, **parameters: Any) -> dict[str, Any]:
        return {"parameters": parameters,
                "inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [value]}]}

    first = await http.post("/v2/models/accumulate/infer", json=body(5, sequence_id=31, sequence_start=True))
    assert first.status_code == 200, first.text
    second = await http.post("/v2/models/accumulate/infer", json=body(6, sequence_id=31, sequence_end=True))
    assert [o["data"] for o in second.json()["outputs"]] == [[11], [11]]
    stale = await http.post("/v2/models/accumulate/infer", json=body(6, sequence_id=31))
    assert stale.status_code == 400 and "must specify the START flag" in stale.json()["error"]


async def test_grpc_sequence_through_tritonclient(server: Server) -> None:
    grpc_server, port = await start_grpc_server(server, "127.0.0.1", 0)
    client = tc_aio.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        sums = []
        for index, value in enumerate((2, 3, 4)):
            data = tc_aio.InferInput("INPUT", [1, 1], "INT32")
            data.set_data_from_numpy(np.array([[value]], np.int32))
            result = await client.infer("accumulate", [data], sequence_id="grpc-seq", sequence_start=index == 0,
                                        sequence_end=index == 2)
            sums.append(int(result.as_numpy("OUTPUT")[0, 0]))
        assert sums == [2, 5, 9]
        with pytest.raises(InferenceServerException, match="must specify the START flag"):
            await client.infer("accumulate", [data], sequence_id="grpc-seq")
    finally:
        await client.close()
        await grpc_server.stop(None)
