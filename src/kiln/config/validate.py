"""Check a completed ModelConfig and turn it into a frozen :class:`ModelSpec`.

Every message names the config file, the field and the value, and says how to fix it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.config._generated import model_config_pb2 as pb
from kiln.config.onnx_io import FileIO, FileTensor
from kiln.config.spec import ModelSpec, TensorSpec
from kiln.errors import ConfigError
from kiln.tensor import DataType

_Tensors = Sequence[pb.ModelInput | pb.ModelOutput]


def validate_config(config: pb.ModelConfig, folder_name: str, source: str, file_io: FileIO | None) -> ModelSpec:
    if config.name != folder_name:
        raise ConfigError(
            f"{source}: name '{config.name}' does not match the model folder '{folder_name}'; "
            f"set name: \"{folder_name}\" or leave the field out"
        )
    if not config.backend:
        raise ConfigError(f"{source}: no backend or platform given and none could be inferred from the model files; "
                          f"set backend: \"onnxruntime\" (or another backend) in the config")
    if config.max_batch_size < 0:
        raise ConfigError(f"{source}: max_batch_size is {config.max_batch_size}; expected 0 (no batching) or more")
    _check_scheduling(config, source)
    _check_version_policy(config, source)
    _check_instance_groups(config, source)
    inputs = _tensor_specs(config.input, "input", source)
    outputs = _tensor_specs(config.output, "output", source)
    if config.backend != "ensemble" and not outputs:
        raise ConfigError(f"{source}: no output is declared; list at least one output (name, data_type, dims)")
    if file_io is not None:
        _check_against_file(config, inputs, file_io.inputs, "input", source)
        _check_against_file(config, outputs, file_io.outputs, "output", source)
    return ModelSpec(
        name=config.name,
        backend=config.backend,
        platform=config.platform,
        max_batch_size=config.max_batch_size,
        inputs=inputs,
        outputs=outputs,
        config=config,
        parameters={key: value.string_value for key, value in config.parameters.items()},
    )


def _tensor_specs(entries: _Tensors, kind: str,
                  source: str) -> tuple[TensorSpec, ...]:
    specs: list[TensorSpec] = []
    seen: set[str] = set()
    for index, entry in enumerate(entries):
        field = f"{kind}[{index}]"
        if not entry.name:
            raise ConfigError(f"{source}: {field} has no name; every {kind} needs name, data_type and dims")
        if entry.name in seen:
            raise ConfigError(f"{source}: {kind} '{entry.name}' is declared twice; tensor names must be unique")
        seen.add(entry.name)
        if entry.data_type == pb.TYPE_INVALID:
            raise ConfigError(f"{source}: {kind} '{entry.name}' has no data_type; set e.g. data_type: TYPE_FP32")
        if entry.data_type not in pb.DataType.values():
            names = ", ".join(name for name in pb.DataType.keys() if name != "TYPE_INVALID")
            raise ConfigError(f"{source}: {kind} '{entry.name}' has data_type {entry.data_type}, which is not a "
                              f"known type; use one of {names}")
        dims = tuple(int(d) for d in entry.dims)
        reshape = tuple(int(d) for d in entry.reshape.shape) if entry.HasField("reshape") else None
        if not dims and reshape is None:
            raise ConfigError(f"{source}: {kind} '{entry.name}' has no dims; set dims: [ ... ] (-1 for any size)")
        for dim in dims:
            if dim == 0 or dim < -1:
                raise ConfigError(f"{source}: {kind} '{entry.name}' has dims {list(dims)}; "
                                  f"each dim must be a positive size or -1 (any size)")
        specs.append(TensorSpec(
            name=entry.name,
            datatype=DataType.from_config(entry.data_type),
            dims=dims,
            reshape=reshape,
            optional=bool(getattr(entry, "optional", False)),
            allow_ragged_batch=bool(getattr(entry, "allow_ragged_batch", False)),
            label_filename=str(getattr(entry, "label_filename", "")),
        ))
    return tuple(specs)


def _check_against_file(config: pb.ModelConfig, specs: tuple[TensorSpec, ...], found: tuple[FileTensor, ...],
                        kind: str, source: str) -> None:
    by_name = {t.name: t for t in found}
    names = ", ".join(by_name) or "none"
    for spec in specs:
        tensor = by_name.get(spec.name)
        if tensor is None:
            raise ConfigError(f"{source}: {kind} '{spec.name}' is not an {kind} of the model file (it has: {names})")
        if spec.datatype is not tensor.datatype:
            raise ConfigError(f"{source}: {kind} '{spec.name}' has data_type {spec.datatype.config_name}, but the "
                              f"model file declares {tensor.datatype.config_name}; use {tensor.datatype.config_name}")
        _check_dims(config, spec, tensor, kind, source)
    if kind == "input":
        declared = {s.name for s in specs}
        missing = [t.name for t in found if t.name not in declared]
        if missing:
            raise ConfigError(f"{source}: the model file needs input(s) {', '.join(missing)} that the config "
                              f"does not declare; add them or remove the input section to auto-complete it")


def _check_dims(config: pb.ModelConfig, spec: TensorSpec, tensor: FileTensor, kind: str, source: str) -> None:
    shape = spec.reshape if spec.reshape is not None else spec.dims
    field = "reshape.shape" if spec.reshape is not None else "dims"
    file_dims = tensor.dims
    if config.max_batch_size > 0:
        if not file_dims or file_dims[0] != -1:
            raise ConfigError(
                f"{source}: max_batch_size is {config.max_batch_size}, but {kind} '{spec.name}' has the fixed "
                f"shape {list(file_dims)} in the model file, so it has no batch dimension; "
                f"set max_batch_size: 0 and dims: {list(file_dims)}"
            )
        file_dims = file_dims[1:]
    if len(shape) != len(file_dims):
        batch_hint = ""
        if config.max_batch_size == 0 and len(shape) + 1 == len(file_dims) and file_dims[0] == -1:
            batch_hint = (f"; the model file has a batch dimension: set max_batch_size > 0 to keep {field} "
                          f"{list(shape)}, or write the full shape {list(file_dims)}")
        raise ConfigError(f"{source}: {kind} '{spec.name}' has {field} {list(shape)} but the model file declares "
                          f"{list(file_dims)}{' after the batch dimension' if config.max_batch_size else ''}"
                          f"{batch_hint or f'; use {field}: {list(file_dims)}'}")
    for mine, theirs in zip(shape, file_dims, strict=True):
        if theirs != -1 and mine != theirs:
            raise ConfigError(f"{source}: {kind} '{spec.name}' has {field} {list(shape)} but the model file "
                              f"declares {list(file_dims)}; use {field}: {list(file_dims)}")


def _check_scheduling(config: pb.ModelConfig, source: str) -> None:
    if not config.HasField("dynamic_batching"):
        return
    batching = config.dynamic_batching
    if config.max_batch_size == 0:
        raise ConfigError(f"{source}: dynamic_batching needs max_batch_size > 0 (it is 0); "
                          f"set max_batch_size or remove dynamic_batching")
    for size in batching.preferred_batch_size:
        if size <= 0 or size > config.max_batch_size:
            raise ConfigError(f"{source}: dynamic_batching.preferred_batch_size {size} is outside "
                              f"1..max_batch_size ({config.max_batch_size})")
    levels = batching.priority_levels
    if levels and not 1 <= batching.default_priority_level <= levels:
        raise ConfigError(f"{source}: dynamic_batching.default_priority_level is {batching.default_priority_level}; "
                          f"expected 1..priority_levels ({levels})")
    for level in batching.priority_queue_policy:
        if not 1 <= level <= levels:
            raise ConfigError(f"{source}: dynamic_batching.priority_queue_policy has level {level}; "
                              f"expected 1..priority_levels ({levels})")


def _check_version_policy(config: pb.ModelConfig, source: str) -> None:
    policy = config.version_policy
    if policy.WhichOneof("policy_choice") == "latest" and policy.latest.num_versions < 1:
        raise ConfigError(f"{source}: version_policy.latest.num_versions is 0; expected 1 or more")
    if policy.WhichOneof("policy_choice") == "specific":
        for version in policy.specific.versions:
            if version < 1:
                raise ConfigError(f"{source}: version_policy.specific.versions has {version}; versions are >= 1")


def _check_instance_groups(config: pb.ModelConfig, source: str) -> None:
    for group in config.instance_group:
        if group.count < 0:
            raise ConfigError(f"{source}: instance_group '{group.name}' has count {group.count}; expected >= 1")
        for gpu in group.gpus:
            if gpu < 0:
                raise ConfigError(f"{source}: instance_group '{group.name}' lists gpu {gpu}; expected >= 0")
