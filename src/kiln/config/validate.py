"""Check a completed ModelConfig and turn it into a frozen :class:`ModelSpec`.

Every message names the config file, the field and the value, and says how to fix it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePosixPath

from kiln.config.autocomplete import sequence_input_names
from kiln.config.onnx_io import FileIO, FileTensor
from kiln.config.spec import ModelSpec, TensorSpec
from kiln.errors import ConfigError
from kiln.tensor import DataType
from kiln.v2._generated import model_config_pb2 as pb

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
    check_file_name(config.default_model_filename, "default_model_filename", source)
    for output in config.output:
        check_file_name(output.label_filename, f"output '{output.name}' label_filename", source)
    _check_scheduling(config, source)
    _check_transaction_policy(config, source)
    _check_version_policy(config, source)
    _check_instance_groups(config, source)
    inputs = _tensor_specs(config.input, "input", source)
    outputs = _tensor_specs(config.output, "output", source)
    if config.backend != "ensemble" and not outputs:
        raise ConfigError(f"{source}: no output is declared; list at least one output (name, data_type, dims)")
    if file_io is not None:
        _check_against_file(config, inputs, file_io.inputs, "input", source)
        _check_against_file(config, outputs, file_io.outputs, "output", source)
    _check_sequence_batching(config, source, file_io)
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
        declared = {s.name for s in specs} | sequence_input_names(config)
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


def check_file_name(name: str, field: str, source: str) -> None:
    """File names in a config name files inside the model's own folder, never elsewhere."""
    if not name:
        return
    path = PurePosixPath(name)
    if path.is_absolute() or "\\" in name or "\0" in name or any(part == ".." for part in path.parts):
        raise ConfigError(f"{source}: {field} is '{name}'; it must be a relative file name inside the model "
                          f"folder (no absolute path, '..' or backslash)")


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


# Backends whose engines can answer a request with any number of responses (engines/python/decoupled.py).
DECOUPLED_BACKENDS = ("python",)


def _check_transaction_policy(config: pb.ModelConfig, source: str) -> None:
    if not config.model_transaction_policy.decoupled:
        return
    if config.backend not in DECOUPLED_BACKENDS:
        raise ConfigError(f"{source}: model_transaction_policy decoupled: true needs a backend that can send any "
                          f"number of responses per request ({', '.join(DECOUPLED_BACKENDS)}); backend "
                          f"'{config.backend}' answers each request once, so remove decoupled")
    if config.HasField("sequence_batching"):
        raise ConfigError(f"{source}: model_transaction_policy decoupled: true with sequence_batching is not "
                          f"supported by kiln; use one of the two")


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


# -- sequence_batching ---------------------------------------------------------------------------------------------

_Control = pb.ModelSequenceBatching.Control
_FALSE_TRUE = {"int32_false_true": DataType.INT32, "fp32_false_true": DataType.FP32, "bool_false_true": DataType.BOOL}
_CORRID_TYPES = (pb.TYPE_UINT64, pb.TYPE_INT64, pb.TYPE_UINT32, pb.TYPE_INT32, pb.TYPE_STRING)


def _check_sequence_batching(config: pb.ModelConfig, source: str, file_io: FileIO | None) -> None:
    """Triton's checks of the section, plus: the server fills control and state inputs, so the config must not
    list them as inputs, and kiln engines return declared outputs only, so state outputs must be listed."""
    if not config.HasField("sequence_batching"):
        return
    batching = config.sequence_batching
    controls = _sequence_controls(batching, source)
    _check_states(batching.state, source)
    _check_sequence_strategy(config, source)
    for state in batching.state:
        if state.input_name in controls:
            raise ConfigError(f"{source}: '{state.input_name}' is both a sequence_batching control input and a "
                              f"state input_name; give them different model inputs")
    filled = sequence_input_names(config)
    for entry in config.input:
        if entry.name in filled:
            raise ConfigError(f"{source}: input '{entry.name}' is a sequence_batching control or state input, which "
                              f"the server fills; remove it from the input list")
    if file_io is not None:
        _check_sequence_file(config, controls, file_io, source)
    declared_outputs = {entry.name for entry in config.output}
    for state in batching.state:
        if state.output_name not in declared_outputs:
            raise ConfigError(f"{source}: sequence_batching state output '{state.output_name}' is not listed in "
                              f"output; add it (auto-complete adds it from an ONNX file)")


def _sequence_controls(batching: pb.ModelSequenceBatching, source: str) -> dict[str, DataType]:
    """Each control input's name with the data type the server feeds it."""
    controls: dict[str, DataType] = {}
    kinds: dict[int, str] = {}
    for index, control_input in enumerate(batching.control_input):
        name = control_input.name
        if not name:
            raise ConfigError(f"{source}: sequence_batching.control_input[{index}] has no name; set name to the "
                              f"model input that carries the control")
        if name in controls:
            raise ConfigError(f"{source}: sequence_batching control input '{name}' is listed twice; list each "
                              f"control tensor once")
        if len(control_input.control) != 1:
            raise ConfigError(f"{source}: sequence_batching control input '{name}' has {len(control_input.control)} "
                              f"controls; give exactly one control {{ kind: ... }} per control input")
        control = control_input.control[0]
        kind = _control_kind(control, name, source)
        if control.kind in kinds:
            raise ConfigError(f"{source}: sequence_batching has two {kind} controls ('{kinds[control.kind]}' and "
                              f"'{name}'); keep one")
        kinds[control.kind] = name
        controls[name] = _control_type(control, name, kind, source)
    return controls


def _control_kind(control: pb.ModelSequenceBatching.Control, name: str, source: str) -> str:
    try:
        return _Control.Kind.Name(control.kind)
    except ValueError:
        kinds = ", ".join(_Control.Kind.keys())
        raise ConfigError(f"{source}: sequence_batching control input '{name}' has kind {control.kind}; expected "
                          f"one of {kinds}") from None


def _control_type(control: pb.ModelSequenceBatching.Control, name: str, kind: str, source: str) -> DataType:
    typed = [field for field in _FALSE_TRUE if len(getattr(control, field))]
    label = f"{source}: sequence_batching control input '{name}' ({kind})"
    if control.kind == _Control.CONTROL_SEQUENCE_CORRID:
        if typed:
            raise ConfigError(f"{label} takes data_type only; remove {typed[0]}")
        if control.data_type not in _CORRID_TYPES:
            raise ConfigError(f"{label} has data_type {pb.DataType.Name(control.data_type)}; expected one of "
                              f"{', '.join(pb.DataType.Name(t) for t in _CORRID_TYPES)}")
        return DataType.from_config(control.data_type)
    if len(typed) != 1:
        found = " and ".join(typed) or "none"
        raise ConfigError(f"{label} needs exactly one of int32_false_true, fp32_false_true or bool_false_true "
                          f"(it has {found}); e.g. int32_false_true: [ 0, 1 ]")
    values = list(getattr(control, typed[0]))
    if len(values) != 2:
        raise ConfigError(f"{label} has {typed[0]} {values}; give exactly two values: [ <false>, <true> ]")
    return _FALSE_TRUE[typed[0]]


def _check_states(states: Sequence[pb.ModelSequenceBatching.State], source: str) -> None:
    seen: set[str] = set()
    for index, state in enumerate(states):
        if not state.input_name or not state.output_name:
            raise ConfigError(f"{source}: sequence_batching.state[{index}] needs input_name and output_name (the "
                              f"model input that reads the state and the output that writes it)")
        label = f"{source}: sequence_batching state '{state.input_name}'"
        if state.input_name in seen:
            raise ConfigError(f"{label} is declared twice; each state input appears once")
        seen.add(state.input_name)
        if state.data_type == pb.TYPE_INVALID or state.data_type not in pb.DataType.values():
            raise ConfigError(f"{label} has no valid data_type; set e.g. data_type: TYPE_FP32")
        dims = [int(d) for d in state.dims]
        if not dims or any(d == 0 or d < -1 for d in dims):
            raise ConfigError(f"{label} has dims {dims}; give each dim as a positive size or -1 (any size)")
        _check_initial_state(state, label)


def _check_initial_state(state: pb.ModelSequenceBatching.State, label: str) -> None:
    if not state.initial_state:
        return
    if len(state.initial_state) > 1:
        raise ConfigError(f"{label} has {len(state.initial_state)} initial_state entries; give at most one")
    initial = state.initial_state[0]
    if initial.data_type != state.data_type:
        raise ConfigError(f"{label} has initial_state data_type {pb.DataType.Name(initial.data_type)} but the state "
                          f"is {pb.DataType.Name(state.data_type)}; make them equal")
    if not initial.name:
        raise ConfigError(f'{label} has an initial_state without a name; set name: "..."')
    if initial.WhichOneof("state_data") is None:
        raise ConfigError(f'{label} has an initial_state with neither zero_data nor data_file; set zero_data: true '
                          f'or data_file: "<file in the model\'s initial_state folder>"')
    wanted, dims = [int(d) for d in initial.dims], [int(d) for d in state.dims]
    if len(wanted) != len(dims) or any(w < 1 or (d != -1 and w != d) for w, d in zip(wanted, dims, strict=False)):
        raise ConfigError(f"{label} has initial_state dims {wanted}, which do not fit the state dims {dims}; give "
                          f"fixed sizes of the same rank, equal where the state's dims are fixed")


def _check_sequence_strategy(config: pb.ModelConfig, source: str) -> None:
    batching = config.sequence_batching
    if batching.WhichOneof("strategy_choice") == "oldest":
        oldest = batching.oldest
        if oldest.max_candidate_sequences < 0:
            raise ConfigError(f"{source}: sequence_batching.oldest.max_candidate_sequences is "
                              f"{oldest.max_candidate_sequences}; expected 0 (= max_batch_size) or more")
        for size in oldest.preferred_batch_size:
            if size <= 0 or size > config.max_batch_size:
                raise ConfigError(f"{source}: sequence_batching.oldest.preferred_batch_size {size} is outside "
                                  f"1..max_batch_size ({config.max_batch_size})")
        return
    utilization = batching.direct.minimum_slot_utilization
    if not 0.0 <= utilization <= 1.0:
        raise ConfigError(f"{source}: sequence_batching.direct.minimum_slot_utilization is {utilization:g}; "
                          f"expected 0.0..1.0")


def _check_sequence_file(config: pb.ModelConfig, controls: dict[str, DataType], file_io: FileIO,
                         source: str) -> None:
    batching = config.max_batch_size > 0
    inputs = {t.name: t for t in file_io.inputs}
    outputs = {t.name: t for t in file_io.outputs}
    for name, datatype in controls.items():
        label = f"sequence_batching control input '{name}'"
        _check_file_tensor(_file_tensor(inputs, name, "input", label, source), datatype, (1,), batching, label,
                           source)
    for state in config.sequence_batching.state:
        datatype = DataType.from_config(state.data_type)
        dims = tuple(int(d) for d in state.dims)
        for name, found, kind in ((state.input_name, inputs, "input"), (state.output_name, outputs, "output")):
            label = f"sequence_batching state {kind} '{name}'"
            _check_file_tensor(_file_tensor(found, name, kind, label, source), datatype, dims, batching, label,
                               source)


def _file_tensor(found: dict[str, FileTensor], name: str, kind: str, label: str, source: str) -> FileTensor:
    tensor = found.get(name)
    if tensor is None:
        raise ConfigError(f"{source}: {label} is not an {kind} of the model file (it has: "
                          f"{', '.join(found) or 'none'})")
    return tensor


def _check_file_tensor(tensor: FileTensor, datatype: DataType, dims: tuple[int, ...], batching: bool, label: str,
                       source: str) -> None:
    """Data type and shape; a control tensor is [1] per row, a state tensor its state dims per row."""
    if tensor.datatype is not datatype:
        raise ConfigError(f"{source}: {label} is {datatype.config_name} in the config, but the model file declares "
                          f"{tensor.datatype.config_name}; make them agree")
    file_dims = tensor.dims
    rest = file_dims[1:] if batching else file_dims
    fits = (not batching or file_dims[:1] == (-1,)) and len(rest) == len(dims)
    if not fits or any(f != d and -1 not in (f, d) for f, d in zip(rest, dims, strict=False)):
        expected = [-1, *dims] if batching else list(dims)
        raise ConfigError(f"{source}: {label} has shape {list(file_dims)} in the model file; expected {expected} "
                          f"(-1 = any size{', the first is the batch dimension' if batching else ''})")
