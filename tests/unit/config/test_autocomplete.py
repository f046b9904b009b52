"""Auto-complete: what a missing or partial config.pbtxt gets from the ONNX file, and the fields every config gets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import numpy_helper

from kiln.config import open_model_dir
from kiln.config.autocomplete import DEFAULT_MAX_BATCH_SIZE, normalize
from kiln.config.parse import parse_config_text
from kiln.errors import ConfigError
from kiln.tensor import DataType
from kiln.testing import onnx_add_sub_model, onnx_identity_model, write_model
from kiln.v2._generated import model_config_pb2 as pb


def _tensors(entries: object) -> list[tuple[str, int, list[int]]]:
    return [(t.name, t.data_type, list(t.dims)) for t in entries]  # type: ignore[attr-defined]


def test_default_max_batch_size_is_tritons() -> None:
    assert DEFAULT_MAX_BATCH_SIZE == 4


def test_no_config_at_all(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "simple", onnx_add_sub_model(DataType.INT32, dims=(16,)))
    config = open_model_dir(folder).spec.config
    assert config.max_batch_size == 4
    assert _tensors(config.input) == [("INPUT0", pb.TYPE_INT32, [16]), ("INPUT1", pb.TYPE_INT32, [16])]
    assert _tensors(config.output) == [("OUTPUT0", pb.TYPE_INT32, [16]), ("OUTPUT1", pb.TYPE_INT32, [16])]
    assert config.WhichOneof("scheduling_choice") == "dynamic_batching"
    assert config.dynamic_batching == pb.ModelDynamicBatching()  # `dynamic_batching { }`: Triton's defaults
    assert (config.name, config.backend, config.platform) == ("simple", "onnxruntime", "onnxruntime_onnx")
    assert config.default_model_filename == "model.onnx"


def test_dynamic_dims_after_batch_stay_dynamic(tmp_path: Path) -> None:
    model = onnx_identity_model(DataType.FP16, dims=("height", None, 3))
    config = open_model_dir(write_model(tmp_path, "m", model)).spec.config
    assert _tensors(config.input) == [("INPUT0", pb.TYPE_FP16, [-1, -1, 3])]
    assert config.max_batch_size == 4


def test_bytes_tensors_become_type_string(tmp_path: Path) -> None:
    config = open_model_dir(write_model(tmp_path, "s", onnx_identity_model(DataType.BYTES, dims=(2,)))).spec.config
    assert _tensors(config.input) == [("INPUT0", pb.TYPE_STRING, [2])]
    assert _tensors(config.output) == [("OUTPUT0", pb.TYPE_STRING, [2])]


def test_default_max_batch_size_parameter(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", onnx_add_sub_model())
    assert open_model_dir(folder, default_max_batch_size=16).spec.max_batch_size == 16
    unbatched = open_model_dir(folder, default_max_batch_size=0).spec
    assert unbatched.max_batch_size == 0
    assert unbatched.inputs[0].dims == (-1, 4)  # full rank when the batch dimension is not implicit
    assert unbatched.config.WhichOneof("scheduling_choice") is None


def test_max_batch_size_one_gets_no_dynamic_batching(tmp_path: Path) -> None:
    config = open_model_dir(write_model(tmp_path, "m", onnx_add_sub_model(), "max_batch_size: 1")).spec.config
    assert config.max_batch_size == 1
    assert config.WhichOneof("scheduling_choice") is None
    assert _tensors(config.input)[0] == ("INPUT0", pb.TYPE_FP32, [4])


def test_default_max_batch_size_one_gets_no_dynamic_batching(tmp_path: Path) -> None:
    spec = open_model_dir(write_model(tmp_path, "m", onnx_add_sub_model()), default_max_batch_size=1).spec
    assert spec.max_batch_size == 1
    assert spec.config.WhichOneof("scheduling_choice") is None


def test_a_chosen_scheduler_is_kept(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", onnx_add_sub_model(), "sequence_batching { max_sequence_idle_microseconds: 5 }")
    config = open_model_dir(folder).spec.config
    assert config.max_batch_size == 4
    assert config.WhichOneof("scheduling_choice") == "sequence_batching"
    assert config.sequence_batching.max_sequence_idle_microseconds == 5


def test_explicit_dynamic_batching_is_kept(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", onnx_add_sub_model(), "dynamic_batching { max_queue_delay_microseconds: 7 }")
    config = open_model_dir(folder).spec.config
    assert config.max_batch_size == 4
    assert config.dynamic_batching.max_queue_delay_microseconds == 7


def test_partial_config_only_max_batch_size(tmp_path: Path) -> None:
    config = open_model_dir(write_model(tmp_path, "m", onnx_add_sub_model(), "max_batch_size: 8")).spec.config
    assert config.max_batch_size == 8
    assert [t.name for t in config.input] == ["INPUT0", "INPUT1"]
    assert [t.name for t in config.output] == ["OUTPUT0", "OUTPUT1"]
    assert all(list(t.dims) == [4] for t in [*config.input, *config.output])
    # A max_batch_size the config chose itself does not turn the dynamic batcher on (Triton's rule).
    assert config.WhichOneof("scheduling_choice") is None


def test_partial_config_some_inputs(tmp_path: Path) -> None:
    text = 'input [ { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]'
    config = open_model_dir(write_model(tmp_path, "m", onnx_add_sub_model(), text)).spec.config
    # The declared input keeps its place; the missing one is appended from the file.
    assert _tensors(config.input) == [("INPUT1", pb.TYPE_FP32, [4]), ("INPUT0", pb.TYPE_FP32, [4])]
    assert [t.name for t in config.output] == ["OUTPUT0", "OUTPUT1"]
    assert config.max_batch_size == 4


def test_partial_entry_gets_data_type_and_dims(tmp_path: Path) -> None:
    text = 'max_batch_size: 2\noutput [ { name: "OUTPUT1" } ]'
    config = open_model_dir(write_model(tmp_path, "m", onnx_add_sub_model(DataType.INT64), text)).spec.config
    assert _tensors(config.output) == [("OUTPUT1", pb.TYPE_INT64, [4]), ("OUTPUT0", pb.TYPE_INT64, [4])]
    assert config.max_batch_size == 2


def test_full_rank_dims_keep_max_batch_size_zero(tmp_path: Path) -> None:
    text = 'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]'
    config = open_model_dir(write_model(tmp_path, "m", onnx_add_sub_model(), text)).spec.config
    assert config.max_batch_size == 0
    assert config.WhichOneof("scheduling_choice") is None
    # Everything the config left out is completed at full rank too.
    assert _tensors(config.input)[1] == ("INPUT1", pb.TYPE_FP32, [-1, 4])
    assert _tensors(config.output) == [("OUTPUT0", pb.TYPE_FP32, [-1, 4]), ("OUTPUT1", pb.TYPE_FP32, [-1, 4])]


def test_fixed_leading_dim_means_no_batching(tmp_path: Path) -> None:
    config = open_model_dir(write_model(tmp_path, "m", onnx_add_sub_model(dims=(2, 4), batch=False))).spec.config
    assert config.max_batch_size == 0
    assert config.WhichOneof("scheduling_choice") is None
    assert _tensors(config.input)[0] == ("INPUT0", pb.TYPE_FP32, [2, 4])


def test_one_fixed_tensor_disables_batching(tmp_path: Path) -> None:
    model = onnx_identity_model(dims=(3,), count=2)
    model.graph.output[1].type.tensor_type.shape.dim[0].dim_value = 5  # OUTPUT1 is [5, 3]
    config = open_model_dir(write_model(tmp_path, "m", model)).spec.config
    assert config.max_batch_size == 0
    assert _tensors(config.output)[1] == ("OUTPUT1", pb.TYPE_FP32, [5, 3])


def test_initializers_listed_as_graph_inputs_are_not_inputs(tmp_path: Path) -> None:
    model = onnx_add_sub_model(dims=(4,), batch=False)
    model.graph.initializer.append(numpy_helper.from_array(np.ones(4, dtype=np.float32), "INPUT1"))
    config = open_model_dir(write_model(tmp_path, "m", model)).spec.config
    assert [t.name for t in config.input] == ["INPUT0"]


def test_autocomplete_off_adds_no_tensors(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", onnx_add_sub_model())
    with pytest.raises(ConfigError) as info:
        open_model_dir(folder, autocomplete=False)
    message = str(info.value)
    assert message.startswith(f"{folder} (no config.pbtxt): no output is declared")
    assert "list at least one output (name, data_type, dims)" in message


def test_autocomplete_off_still_normalizes(tmp_path: Path) -> None:
    text = ('input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1, 4 ] }, '
            '{ name: "INPUT1" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]\n'
            'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]')
    config = open_model_dir(write_model(tmp_path, "m", onnx_add_sub_model(), text), autocomplete=False).spec.config
    assert len(config.output) == 1
    assert (config.name, config.backend, config.platform) == ("m", "onnxruntime", "onnxruntime_onnx")
    assert [(g.name, g.count, g.kind) for g in config.instance_group] == [("m_0", 1, pb.ModelInstanceGroup.KIND_CPU)]


# -- normalize(): independent of the model file


def _normalized(text: str, folder: str = "folder") -> pb.ModelConfig:
    config = parse_config_text(text)
    normalize(config, folder, f"{folder}/config.pbtxt")
    return config


def test_normalize_name() -> None:
    assert _normalized('backend: "onnxruntime"').name == "folder"
    assert _normalized('name: "given" backend: "onnxruntime"').name == "given"  # validate() checks it


@pytest.mark.parametrize(
    ("text", "backend", "platform", "filename"),
    [
        ('backend: "onnxruntime"', "onnxruntime", "onnxruntime_onnx", "model.onnx"),
        ('platform: "onnxruntime_onnx"', "onnxruntime", "onnxruntime_onnx", "model.onnx"),
        ('platform: "pytorch_libtorch"', "pytorch", "pytorch_libtorch", "model.pt"),
        ('platform: "libtorch"', "pytorch", "libtorch", "model.pt"),
        ('platform: "torch_aoti"', "pytorch", "torch_aoti", "model.pt2"),
        ('backend: "pytorch" platform: "torch_aoti"', "pytorch", "torch_aoti", "model.pt2"),
        ('backend: "tensorrt"', "tensorrt", "tensorrt_plan", "model.plan"),
        ('backend: "python"', "python", "", "model.py"),
        ('backend: "identity"', "identity", "", ""),
        ('platform: "ensemble"', "ensemble", "ensemble", ""),
        ('backend: "onnxruntime" default_model_filename: "net.onnx"', "onnxruntime", "onnxruntime_onnx", "net.onnx"),
    ],
)
def test_normalize_backend_platform_filename(text: str, backend: str, platform: str, filename: str) -> None:
    config = _normalized(text)
    assert (config.backend, config.platform, config.default_model_filename) == (backend, platform, filename)


def test_normalize_version_policy() -> None:
    assert _normalized('backend: "onnxruntime"').version_policy == pb.ModelVersionPolicy(
        latest=pb.ModelVersionPolicy.Latest(num_versions=1))
    kept = _normalized('backend: "onnxruntime" version_policy: { all: { } }').version_policy
    assert kept.WhichOneof("policy_choice") == "all"
    specific = _normalized('backend: "onnxruntime" version_policy: { specific: { versions: [ 2 ] } }').version_policy
    assert list(specific.specific.versions) == [2]


def test_normalize_default_instance_group() -> None:
    groups = _normalized('backend: "onnxruntime"', folder="resnet").instance_group
    assert [(g.name, g.count, g.kind, list(g.gpus)) for g in groups] == [
        ("resnet_0", 1, pb.ModelInstanceGroup.KIND_CPU, [])
    ]


def test_normalize_instance_groups() -> None:
    text = """backend: "onnxruntime"
    instance_group [
      { kind: KIND_AUTO },
      { kind: KIND_AUTO gpus: [ 0, 1 ] count: 2 },
      { name: "mine" kind: KIND_GPU },
      { kind: KIND_CPU count: 3 },
      { kind: KIND_MODEL }
    ]"""
    groups = _normalized(text, folder="m").instance_group
    kinds = pb.ModelInstanceGroup
    assert [(g.name, g.count, g.kind) for g in groups] == [
        ("m_0", 1, kinds.KIND_CPU),  # KIND_AUTO without GPUs -> CPU
        ("m_1", 2, kinds.KIND_GPU),  # KIND_AUTO with listed GPUs -> GPU
        ("mine", 1, kinds.KIND_GPU),
        ("m_3", 3, kinds.KIND_CPU),
        ("m_4", 1, kinds.KIND_MODEL),
    ]


def test_normalize_ensemble_gets_no_instance_group() -> None:
    config = _normalized('platform: "ensemble" ensemble_scheduling { step [ { model_name: "a" } ] }')
    assert list(config.instance_group) == []


def test_normalize_is_idempotent() -> None:
    once = _normalized('backend: "onnxruntime" instance_group [ { count: 2 } ]')
    twice = pb.ModelConfig()
    twice.CopyFrom(once)
    normalize(twice, "folder", "folder/config.pbtxt")
    assert twice == once
