"""Fill in what a partial or missing config.pbtxt leaves out, the way Triton does.

From the model file: inputs (except the sequence batcher's control and state inputs, which the server fills),
outputs (names, data types, dims) and max_batch_size (the default, 4, when every tensor has a dynamic leading
dimension and the config did not spell out full-rank dims); then dynamic batching when that auto-completed
max_batch_size is > 1 and no scheduler is chosen. Independent of the file: name, backend/platform, default
model file name, version policy and instance groups.
"""

from __future__ import annotations

from typing import cast

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from kiln.config.backends import default_filename, resolve_backend
from kiln.config.onnx_io import FileIO, FileTensor
from kiln.v2._generated import model_config_pb2 as pb

DEFAULT_MAX_BATCH_SIZE = 4
SEQUENCE_IDLE_DEFAULT_US = 1_000_000  # Triton's default max_sequence_idle_microseconds

_Tensors = RepeatedCompositeFieldContainer[pb.ModelInput] | RepeatedCompositeFieldContainer[pb.ModelOutput]


def complete_from_file(config: pb.ModelConfig, file_io: FileIO, default_max_batch_size: int) -> None:
    """Complete ``config`` in place from the tensors the model file declares."""
    completed_batching = (config.max_batch_size == 0 and file_io.supports_batching()
                          and not _declares_full_rank(config, file_io))
    if completed_batching:
        config.max_batch_size = default_max_batch_size
    batching = config.max_batch_size > 0
    server_filled = sequence_input_names(config)
    _complete_tensors(config.input, tuple(t for t in file_io.inputs if t.name not in server_filled), batching)
    _complete_tensors(config.output, file_io.outputs, batching)
    # Like Triton, only a batch size that auto-complete chose turns the dynamic batcher on; a config that sets
    # max_batch_size itself decides its scheduler.
    if completed_batching and config.max_batch_size > 1 and config.WhichOneof("scheduling_choice") is None:
        config.dynamic_batching.SetInParent()


def sequence_input_names(config: pb.ModelConfig) -> set[str]:
    """Model inputs the sequence batcher fills (control and implicit-state inputs): never request inputs."""
    if not config.HasField("sequence_batching"):
        return set()
    batching = config.sequence_batching
    return {c.name for c in batching.control_input} | {s.input_name for s in batching.state}


def normalize(config: pb.ModelConfig, folder_name: str, source: str) -> None:
    """Fill the fields every loaded config has, whatever its backend."""
    if not config.name:
        config.name = folder_name
    backend, platform = resolve_backend(config.backend, config.platform, source)
    config.backend, config.platform = backend, platform
    if not config.default_model_filename:
        config.default_model_filename = default_filename(backend, platform)
    if config.WhichOneof("scheduling_choice") != "ensemble_scheduling":
        _normalize_instance_groups(config)
    if config.version_policy.WhichOneof("policy_choice") is None:
        config.version_policy.latest.num_versions = 1
    if config.HasField("sequence_batching") and not config.sequence_batching.max_sequence_idle_microseconds:
        config.sequence_batching.max_sequence_idle_microseconds = SEQUENCE_IDLE_DEFAULT_US


def _declares_full_rank(config: pb.ModelConfig, file_io: FileIO) -> bool:
    """A config listing dims with the file's full rank means 'no implicit batch dimension'."""
    ranks = {t.name: len(t.dims) for t in file_io.inputs + file_io.outputs}
    tensors = list(config.input) + list(config.output)
    return any(t.dims and len(t.dims) == ranks.get(t.name) for t in tensors)


def _complete_tensors(declared: _Tensors, found: tuple[FileTensor, ...], batching: bool) -> None:
    """Only a dynamic leading dimension is the batch dimension; a fixed one stays so validation can explain it."""
    by_name = {t.name: t for t in declared}
    for tensor in found:
        entry = by_name.get(tensor.name)
        if entry is None:
            entry = declared.add()
            entry.name = tensor.name
        if entry.data_type == pb.TYPE_INVALID:
            entry.data_type = cast("pb.DataType", tensor.datatype.config_number)
        if not entry.dims and not entry.HasField("reshape"):
            skip = 1 if batching and tensor.dims[:1] == (-1,) else 0
            entry.dims.extend(tensor.dims[skip:])


def _normalize_instance_groups(config: pb.ModelConfig) -> None:
    if not config.instance_group:
        config.instance_group.add()
    for index, group in enumerate(config.instance_group):
        if not group.name:
            group.name = f"{config.name}_{index}"
        if group.count == 0:
            group.count = 1
        if group.kind == pb.ModelInstanceGroup.KIND_AUTO:
            # KIND_AUTO means GPU when the listed GPUs exist; kiln's default engines run on the CPU unless asked.
            # A TensorRT plan only runs on a GPU.
            gpu = bool(group.gpus) or config.backend == "tensorrt"
            group.kind = pb.ModelInstanceGroup.KIND_GPU if gpu else pb.ModelInstanceGroup.KIND_CPU
