"""Ensembles are checked at load: first the step graph on its own, then each step against the model it calls.
A broken ensemble stays UNAVAILABLE with a reason that names the ensemble, the step, the tensor and what is
expected; the other models keep serving."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.errors import ModelNotReadyError
from kiln.server.server import Server, ServerOptions
from kiln.tensor import DataType
from kiln.testing.repo import make_repo, onnx_add_sub_model, onnx_identity_model, write_model
from kiln.v2.types import InferRequest

HEAD = """name: "ens"
platform: "ensemble"
max_batch_size: 4
input [ { name: "A" data_type: TYPE_FP32 dims: [4] }, { name: "B" data_type: TYPE_FP32 dims: [4] } ]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [4] } ]
"""

ADD = ('{ model_name: "add_sub" model_version: -1 input_map { key: "INPUT0" value: "A" } '
       'input_map { key: "INPUT1" value: "B" } output_map { key: "OUTPUT0" value: "s" } }')
IDENT = '{ model_name: "ident" model_version: -1 input_map { key: "INPUT0" value: "s" } ' \
        'output_map { key: "OUTPUT0" value: "SUM" } }'


def steps(*entries: str) -> str:
    return "ensemble_scheduling { step [ " + ", ".join(entries) + " ] }\n"


def reason_for(tmp_path: Path, config: str, **extra_models: object) -> str:
    models = {"add_sub": onnx_add_sub_model(), "ident": onnx_identity_model(), **extra_models}
    root = make_repo(tmp_path, **models)  # type: ignore[arg-type]
    write_model(root, "ens", None, config)
    server = Server(ServerOptions(repositories=[root]))
    try:
        server.start()
        assert server.model_ready("add_sub") and server.model_ready("ident")  # the rest keeps serving
        entry = next(e for e in server.repository_index() if e.name == "ens")
        if entry.state == "READY":
            return ""
        return entry.reason
    finally:
        server.close()


def test_a_valid_ensemble_is_ready(tmp_path: Path) -> None:
    assert reason_for(tmp_path, HEAD + steps(ADD, IDENT)) == ""


@pytest.mark.parametrize(("config", "expected"), [
    (HEAD, "platform 'ensemble' needs ensemble_scheduling with at least one step"),
    (HEAD + steps(ADD, IDENT.replace('value: "s"', 'value: "nothing"')),
     "step 1 (model 'ident') reads 'nothing' for its input 'INPUT0', but no ensemble input or step output"),
    (HEAD + steps(ADD), "ensemble output 'SUM' is not written by any step"),
    (HEAD + steps(ADD, IDENT, IDENT.replace('"ident"', '"ident2"')),
     "tensor 'SUM' is written by step 1 and by step 2 (model 'ident2')"),
    (HEAD + steps(ADD.replace('value: "B"', 'value: "A"'), IDENT), "ensemble input(s) B are not read by any step"),
    (HEAD + steps(ADD.replace('value: "B"', 'value: "t"'), IDENT,
                  '{ model_name: "add_sub" input_map { key: "INPUT0" value: "s" } input_map { key: "INPUT1" '
                  'value: "B" } output_map { key: "OUTPUT0" value: "t" } }'),
     "the ensemble steps form a cycle; these steps wait on each other's outputs: step 0 (model 'add_sub'), "
     "step 1 (model 'ident'), step 2 (model 'add_sub')"),
    (HEAD + steps(ADD, IDENT.replace('"ident"', '"ens"')), "calls the ensemble 'ens' itself"),
    (HEAD + steps(ADD.replace("model_version: -1", "model_version: -3"), IDENT),
     "model_version -3 is not valid; expected -1 (the newest ready version) or a version number"),
    (HEAD + steps(ADD, IDENT.replace('value: "SUM"', 'value: "A"')),
     "writes output 'OUTPUT0' to 'A', which is an ensemble input"),
])
def test_the_step_graph_is_checked(tmp_path: Path, config: str, expected: str) -> None:
    assert expected in reason_for(tmp_path, config)


@pytest.mark.parametrize(("config", "expected"), [
    (HEAD + steps(ADD, IDENT.replace('"ident"', '"missing"')),
     "ensemble 'ens': step 1 (model 'missing') cannot run: model 'missing' is not loaded"),
    (HEAD + steps(ADD, IDENT.replace('key: "INPUT0"', 'key: "IN"')),
     "step 1 (model 'ident'): input_map names 'IN', which is not an input of the model; its inputs are INPUT0"),
    (HEAD + steps(ADD, IDENT.replace('key: "OUTPUT0"', 'key: "OUT"')),
     "output_map names 'OUT', which is not an output of the model; its outputs are OUTPUT0"),
    (HEAD + steps(ADD, IDENT.replace('"ident"', '"ident_int"')),
     "tensor 's' -> input 'INPUT0': step 0 (model 'add_sub') output 'OUTPUT0' is FP32 but INT32 is expected"),
    (HEAD + steps(ADD, IDENT.replace('"ident"', '"ident_wide"')),
     "step 0 (model 'add_sub') output 'OUTPUT0' has shape [-1, 4] but [-1, 8] is expected"),
    (HEAD.replace("max_batch_size: 4", "max_batch_size: 16") + steps(ADD, IDENT),
     "the ensemble has max_batch_size 16 but the model's is 4"),
    (HEAD.replace('output [ { name: "SUM" data_type: TYPE_FP32', 'output [ { name: "SUM" data_type: TYPE_FP16')
     + steps(ADD, IDENT), "ensemble output 'SUM': step 1 (model 'ident') output 'OUTPUT0' is FP32 but FP16"),
])
def test_each_step_is_checked_against_its_model(tmp_path: Path, config: str, expected: str) -> None:
    extra = {"ident_int": onnx_identity_model(DataType.INT32), "ident_wide": onnx_identity_model(dims=(8,))}
    assert expected in reason_for(tmp_path, config, **extra)


def test_every_required_model_input_is_mapped(tmp_path: Path) -> None:
    head = HEAD.replace(', { name: "B" data_type: TYPE_FP32 dims: [4] }', "")
    config = head + steps(ADD.replace('input_map { key: "INPUT1" value: "B" } ', ""), IDENT)
    assert "step 0 (model 'add_sub'): the model's input(s) INPUT1 are not in the step's input_map" in \
        reason_for(tmp_path, config)


def test_requests_to_a_broken_ensemble_name_the_reason(tmp_path: Path) -> None:
    root = make_repo(tmp_path, add_sub=onnx_add_sub_model())
    write_model(root, "ens", None, HEAD + steps(ADD, IDENT))
    server = Server(ServerOptions(repositories=[root]))
    try:
        assert server.start() == ["ens"]
        assert not server.model_ready("ens")
        with pytest.raises(ModelNotReadyError, match="model 'ens' has no version ready to serve: ensemble 'ens': "
                                                     "step 1 \\(model 'ident'\\) cannot run"):
            server.infer_sync(InferRequest("ens", []))
    finally:
        server.close()
