"""Validation: every rejected config names the file, the field and the value, and says how to fix it."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from kiln.config import ModelSpec, TensorSpec, open_model_dir
from kiln.config.parse import parse_config_text
from kiln.config.validate import validate_config
from kiln.errors import ConfigError, InvalidArgumentError
from kiln.tensor import DataType
from kiln.testing import onnx_add_sub_model, onnx_identity_model, write_model

FP32_IN = ('input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, '
           '{ name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]')
FP32_OUT = ('output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, '
            '{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]')
IDENTITY = 'backend: "identity"\n'
ONE_OUT = 'output [ { name: "O" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'


def _batched() -> onnx.ModelProto:
    return onnx_add_sub_model(dims=(4,))  # [-1, 4]


def _unbatched() -> onnx.ModelProto:
    return onnx_add_sub_model(dims=(4,), batch=False)  # [4]


def _fixed_2x4() -> onnx.ModelProto:
    return onnx_add_sub_model(dims=(2, 4), batch=False)  # [2, 4]


# (id, model, config text, folder name, open_model_dir kwargs, fragments every message must contain)
CASES: list[tuple[str, onnx.ModelProto | None, str, list[str]]] = [
    ("name-mismatch", _batched(), 'name: "other"',
     ["name 'other' does not match the model folder 'm'", 'set name: "m" or leave the field out']),
    ("unknown-backend", _batched(), 'backend: "tensorflow"',
     ["backend 'tensorflow' is not supported", "expected one of: onnxruntime, pytorch, tensorrt, python, identity"]),
    ("unknown-platform", _batched(), 'platform: "tensorflow_savedmodel"',
     ["platform 'tensorflow_savedmodel' is not supported", "expected one of: onnxruntime_onnx, pytorch_libtorch"]),
    ("backend-platform-conflict", _batched(), 'backend: "pytorch" platform: "onnxruntime_onnx"',
     ["platform 'onnxruntime_onnx' belongs to backend 'onnxruntime', but backend is 'pytorch'",
      "remove one of the two or make them agree"]),
    ("no-backend", None, "max_batch_size: 1",
     ["no backend or platform given and none could be inferred from the model files",
      'set backend: "onnxruntime"']),
    ("negative-max-batch-size", _batched(), "max_batch_size: -1",
     ["max_batch_size is -1; expected 0 (no batching) or more"]),
    ("missing-dims", None, IDENTITY + 'input [ { name: "I" data_type: TYPE_FP32 } ]\n' + ONE_OUT,
     ["input 'I' has no dims", "set dims: [ ... ] (-1 for any size)"]),
    ("zero-dim", None, IDENTITY + 'input [ { name: "I" data_type: TYPE_FP32 dims: [ 3, 0 ] } ]\n' + ONE_OUT,
     ["input 'I' has dims [3, 0]", "each dim must be a positive size or -1 (any size)"]),
    ("negative-dim", None, IDENTITY + 'input [ { name: "I" data_type: TYPE_FP32 dims: [ -2 ] } ]\n' + ONE_OUT,
     ["input 'I' has dims [-2]", "each dim must be a positive size or -1"]),
    ("output-zero-dim", None, IDENTITY + 'output [ { name: "O" data_type: TYPE_FP32 dims: [ 0 ] } ]',
     ["output 'O' has dims [0]", "each dim must be a positive size or -1"]),
    ("duplicate-input", None, IDENTITY + 'input [ { name: "I" data_type: TYPE_FP32 dims: [ 1 ] }, '
     '{ name: "I" data_type: TYPE_FP32 dims: [ 1 ] } ]\n' + ONE_OUT,
     ["input 'I' is declared twice; tensor names must be unique"]),
    ("duplicate-output", None, IDENTITY + 'output [ { name: "O" data_type: TYPE_FP32 dims: [ 1 ] }, '
     '{ name: "O" data_type: TYPE_INT32 dims: [ 2 ] } ]',
     ["output 'O' is declared twice; tensor names must be unique"]),
    ("unnamed-input", None, IDENTITY + "input [ { data_type: TYPE_FP32 dims: [ 1 ] } ]\n" + ONE_OUT,
     ["input[0] has no name", "every input needs name, data_type and dims"]),
    ("no-data-type", None, IDENTITY + ONE_OUT + 'input [ { name: "I" dims: [ 1 ] } ]',
     ["input 'I' has no data_type", "set e.g. data_type: TYPE_FP32"]),
    ("no-outputs", None, IDENTITY + 'input [ { name: "I" data_type: TYPE_FP32 dims: [ 1 ] } ]',
     ["no output is declared", "list at least one output (name, data_type, dims)"]),
    ("dims-wrong-value-batched", _batched(), "max_batch_size: 4\n" + FP32_IN.replace("[ 4 ] }, {", "[ 5 ] }, {"),
     ["input 'INPUT0' has dims [5] but the model file declares [4]", "use dims: [4]"]),
    ("dims-wrong-rank-batched", _batched(), "max_batch_size: 4\n" + FP32_IN.replace("[ 4 ] }, {", "[ 4, 1 ] }, {"),
     ["input 'INPUT0' has dims [4, 1] but the model file declares [4] after the batch dimension", "use dims: [4]"]),
    ("dims-wrong-value-unbatched", _unbatched(), FP32_IN.replace("[ 4 ] }, {", "[ 3 ] }, {"),
     ["input 'INPUT0' has dims [3] but the model file declares [4]", "use dims: [4]"]),
    ("dims-wrong-rank-unbatched", _unbatched(), FP32_IN.replace("[ 4 ] }, {", "[ 1, 4 ] }, {"),
     ["input 'INPUT0' has dims [1, 4] but the model file declares [4]; use dims: [4]"]),
    ("output-dims-wrong", _batched(), 'output [ { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 8 ] } ]',
     ["output 'OUTPUT1' has dims [8] but the model file declares [4]", "use dims: [4]"]),
    # A config that spells out one full-rank tensor keeps max_batch_size 0, so a batch-less input is off by one.
    ("batch-dimension-hint", _batched(),
     'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
     'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]',
     ["input 'INPUT0' has dims [4] but the model file declares [-1, 4]",
      "the model file has a batch dimension: set max_batch_size > 0 to keep dims [4], "
      "or write the full shape [-1, 4]"]),
    ("data-type-vs-file", _batched(), 'input [ { name: "INPUT1" data_type: TYPE_FP16 dims: [ 4 ] } ]',
     ["input 'INPUT1' has data_type TYPE_FP16, but the model file declares TYPE_FP32; use TYPE_FP32"]),
    ("output-data-type-vs-file", _batched(), 'output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 4 ] } ]',
     ["output 'OUTPUT0' has data_type TYPE_STRING, but the model file declares TYPE_FP32"]),
    ("input-not-in-file", _batched(), 'input [ { name: "IMAGE" data_type: TYPE_FP32 dims: [ 4 ] } ]',
     ["input 'IMAGE' is not an input of the model file (it has: INPUT0, INPUT1)"]),
    ("output-not-in-file", _batched(), 'output [ { name: "PROBS" data_type: TYPE_FP32 dims: [ 4 ] } ]',
     ["output 'PROBS' is not an output of the model file (it has: OUTPUT0, OUTPUT1)"]),
    ("fixed-first-dim-with-batching", _fixed_2x4(), "max_batch_size: 8",
     ["max_batch_size is 8, but input 'INPUT0' has the fixed shape [2, 4] in the model file",
      "so it has no batch dimension", "set max_batch_size: 0 and dims: [2, 4]"]),
    ("dynamic-batching-without-max-batch-size", _batched(),
     'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]\ndynamic_batching { }',
     ["dynamic_batching needs max_batch_size > 0 (it is 0)", "set max_batch_size or remove dynamic_batching"]),
    ("preferred-batch-size-too-large", _batched(),
     "max_batch_size: 4\ndynamic_batching { preferred_batch_size: [ 2, 8 ] }",
     ["dynamic_batching.preferred_batch_size 8 is outside 1..max_batch_size (4)"]),
    ("preferred-batch-size-zero", _batched(), "max_batch_size: 4\ndynamic_batching { preferred_batch_size: [ 0 ] }",
     ["dynamic_batching.preferred_batch_size 0 is outside 1..max_batch_size (4)"]),
    ("default-priority-level-too-high", _batched(),
     "dynamic_batching { priority_levels: 2 default_priority_level: 3 }",
     ["dynamic_batching.default_priority_level is 3; expected 1..priority_levels (2)"]),
    ("default-priority-level-zero", _batched(), "dynamic_batching { priority_levels: 2 }",
     ["dynamic_batching.default_priority_level is 0; expected 1..priority_levels (2)"]),
    ("priority-queue-policy-level", _batched(),
     "dynamic_batching { priority_levels: 2 default_priority_level: 1 "
     "priority_queue_policy { key: 5 value: { max_queue_size: 1 } } }",
     ["dynamic_batching.priority_queue_policy has level 5; expected 1..priority_levels (2)"]),
    ("latest-zero", _batched(), "version_policy: { latest: { num_versions: 0 } }",
     ["version_policy.latest.num_versions is 0; expected 1 or more"]),
    ("specific-zero", _batched(), "version_policy: { specific: { versions: [ 1, 0 ] } }",
     ["version_policy.specific.versions has 0; versions are >= 1"]),
    ("instance-count-negative", _batched(), 'instance_group [ { name: "g" count: -2 } ]',
     ["instance_group 'g' has count -2; expected >= 1"]),
    ("instance-gpu-negative", _batched(), 'instance_group [ { name: "g" gpus: [ -1 ] } ]',
     ["instance_group 'g' lists gpu -1; expected >= 0"]),
]


@pytest.mark.parametrize(("model", "text", "fragments"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rejected(tmp_path: Path, model: onnx.ModelProto | None, text: str, fragments: list[str]) -> None:
    folder = write_model(tmp_path, "m", model, text)
    with pytest.raises(ConfigError) as info:
        open_model_dir(folder)
    message = str(info.value)
    assert message.startswith(f"{folder / 'config.pbtxt'}: "), message
    for fragment in fragments:
        assert fragment in message, message


def test_file_input_missing_from_config(tmp_path: Path) -> None:
    text = "max_batch_size: 4\n" + FP32_IN.replace(', { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }', "")
    folder = write_model(tmp_path, "m", _batched(), text + "\n" + FP32_OUT)
    with pytest.raises(ConfigError) as info:
        open_model_dir(folder, autocomplete=False)
    assert str(info.value) == (
        f"{folder / 'config.pbtxt'}: the model file needs input(s) INPUT1 that the config does not declare; "
        "add them or remove the input section to auto-complete it"
    )


def test_batch_dimension_hint_without_autocomplete(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", _batched(), FP32_IN + "\n" + FP32_OUT)
    with pytest.raises(ConfigError, match=r"set max_batch_size > 0 to keep dims \[4\], or write the full shape"):
        open_model_dir(folder, autocomplete=False)


def test_reshape_is_checked_instead_of_dims(tmp_path: Path) -> None:
    model = onnx_identity_model(dims=(6,))
    good = ('max_batch_size: 2\ninput [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2, 3 ] '
            "reshape: { shape: [ 6 ] } } ]")
    spec = open_model_dir(write_model(tmp_path, "good", model, good)).spec
    assert spec.inputs[0].dims == (2, 3)
    assert spec.inputs[0].reshape == (6,)
    bad = good.replace("shape: [ 6 ]", "shape: [ 5 ]")
    folder = write_model(tmp_path, "bad", model, bad)
    with pytest.raises(ConfigError) as info:
        open_model_dir(folder)
    assert str(info.value) == (f"{folder / 'config.pbtxt'}: input 'INPUT0' has reshape.shape [5] but the model file "
                               "declares [6]; use reshape.shape: [6]")


def test_dynamic_file_dims_accept_any_config_size(tmp_path: Path) -> None:
    text = 'max_batch_size: 2\ninput [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 7, -1 ] } ]'
    spec = open_model_dir(write_model(tmp_path, "m", onnx_identity_model(dims=(None, None)), text)).spec
    assert spec.inputs[0].dims == (7, -1)


def test_fixed_rank_one_file_with_batching(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", _unbatched(), "max_batch_size: 2")
    with pytest.raises(ConfigError, match=r"max_batch_size is 2, but input 'INPUT0' has the fixed shape \[4\]"):
        open_model_dir(folder)


def test_unknown_data_type_number_names_file_and_tensor(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", None, IDENTITY + ONE_OUT + 'input [ { name: "I" data_type: 99 dims: [ 1 ] } ]')
    with pytest.raises(ConfigError) as info:
        open_model_dir(folder)
    assert str(info.value).startswith(f"{folder / 'config.pbtxt'}: input 'I'")
    assert "99" in str(info.value)


def test_valid_config_becomes_a_frozen_spec(tmp_path: Path) -> None:
    text = ('max_batch_size: 8\n' + FP32_IN.replace('dims: [ 4 ] }, {', 'dims: [ 4 ] optional: true }, {') + "\n"
            + 'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] label_filename: "labels.txt" } ]\n'
            + 'parameters { key: "k" value: { string_value: "v" } }')
    spec = open_model_dir(write_model(tmp_path, "m", _batched(), text)).spec
    assert (spec.name, spec.backend, spec.platform, spec.max_batch_size) == ("m", "onnxruntime", "onnxruntime_onnx", 8)
    assert spec.batching
    assert spec.inputs[0] == TensorSpec("INPUT0", DataType.FP32, (4,), optional=True)
    assert spec.outputs[0] == TensorSpec("OUTPUT0", DataType.FP32, (4,), label_filename="labels.txt")
    assert [t.name for t in spec.outputs] == ["OUTPUT0", "OUTPUT1"]  # the other output was auto-completed
    assert dict(spec.parameters) == {"k": "v"}
    assert spec.request_shape(spec.inputs[0]) == (-1, 4)
    assert spec.inputs[0].describe() == {"name": "INPUT0", "datatype": "FP32", "shape": [4]}
    with pytest.raises(AttributeError):
        spec.max_batch_size = 1  # type: ignore[misc]


def test_spec_lookup_errors_name_model_and_choices(tmp_path: Path) -> None:
    spec = open_model_dir(write_model(tmp_path, "m", _batched())).spec
    assert spec.input("INPUT1").name == "INPUT1"
    assert spec.output("OUTPUT1").name == "OUTPUT1"
    with pytest.raises(InvalidArgumentError, match="model 'm' has no input 'X'; expected one of: INPUT0, INPUT1"):
        spec.input("X")
    with pytest.raises(InvalidArgumentError, match="model 'm' has no output 'Y'; expected one of: OUTPUT0, OUTPUT1"):
        spec.output("Y")


def test_unbatched_request_shape(tmp_path: Path) -> None:
    spec = open_model_dir(write_model(tmp_path, "m", _fixed_2x4())).spec
    assert not spec.batching
    assert spec.request_shape(spec.inputs[0]) == (2, 4)


def test_ensemble_needs_no_outputs_check_and_no_file() -> None:
    config = parse_config_text('name: "e" backend: "ensemble" platform: "ensemble"')
    spec = validate_config(config, "e", "e/config.pbtxt", None)
    assert isinstance(spec, ModelSpec)
    assert (spec.backend, spec.outputs) == ("ensemble", ())


def test_validate_config_uses_the_given_source() -> None:
    config = parse_config_text('name: "a" backend: "identity"')
    with pytest.raises(ConfigError, match=r"^where/it/came/from: name 'a' does not match the model folder 'b'"):
        validate_config(config, "b", "where/it/came/from", None)
