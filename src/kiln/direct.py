"""The direct path: load a model into an in-process engine, with nothing in between."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, cast

from kiln.config.backends import FILE_BACKENDS
from kiln.config.model_dir import ModelDir, open_model_dir
from kiln.config.onnx_io import FileTensor, read_onnx_io
from kiln.config.spec import ModelSpec
from kiln.config.validate import validate_config
from kiln.engines.base import Engine, EngineOptions, create_engine, instance_group_options
from kiln.errors import ConfigError, InvalidArgumentError, ModelNotFoundError
from kiln.v2._generated import model_config_pb2 as pb


def load(path: str | Path, version: int | None = None, **options: Any) -> Engine:
    """Load a model file (``model.onnx``) or a model folder (``<repo>/<model>``) into an engine.

    ``version`` picks a version folder (default: the newest the version policy serves). ``options`` are the
    fields of :class:`~kiln.engines.EngineOptions`: ``kind`` ("cpu" or "gpu"), ``device_id``,
    ``intra_op_threads``, ``inter_op_threads``. Those not given come from the folder's config, as the server's
    first instance would have them: a ``KIND_GPU`` instance group means ``kind="gpu"`` on its first listed GPU.
    A bare model file runs on the CPU unless told otherwise.
    """
    _check_option_names(options)
    path = Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"{path}: no such model file or folder")
    if path.is_file() or path.suffix == ".onnx":
        if version is not None:
            raise InvalidArgumentError(f"{path}: version={version} applies to model folders, not to a model file")
        return create_engine(_spec_for_file(path), path, EngineOptions(**options))
    model_dir = open_model_dir(path)
    chosen = _choose_version(model_dir, version)
    engine_options = dataclasses.replace(config_engine_options(model_dir.spec), **options)
    return create_engine(model_dir.spec, model_dir.model_file(chosen), engine_options)


def config_engine_options(spec: ModelSpec) -> EngineOptions:
    """Where the server would put the config's first instance: the GPU its group lists first for KIND_GPU
    (device 0 when it lists none), else the CPU."""
    groups = spec.config.instance_group
    first = instance_group_options(groups[0]) if groups else []
    return first[0] if first else EngineOptions()


def _check_option_names(options: dict[str, Any]) -> None:
    known = EngineOptions.__dataclass_fields__
    unknown = [name for name in options if name not in known]
    if unknown:
        raise InvalidArgumentError(f"unknown load option(s) {', '.join(unknown)}; expected: {', '.join(known)}")


def _choose_version(model_dir: ModelDir, version: int | None) -> int:
    if version is not None:
        if version not in model_dir.versions:
            available = ", ".join(str(v) for v in model_dir.versions)
            raise ModelNotFoundError(f"model '{model_dir.name}' has no version {version} (available: {available})")
        return version
    served = model_dir.served_versions()
    if not served:
        raise ModelNotFoundError(f"model '{model_dir.name}': its version_policy selects none of the versions "
                                 f"{', '.join(str(v) for v in model_dir.versions)}")
    return served[-1]


def _spec_for_file(path: Path) -> ModelSpec:
    """A bare model file has no config: its own dims are used as they are, batch dimension included."""
    matches = [(backend, platform) for name, backend, platform in FILE_BACKENDS if path.suffix == Path(name).suffix]
    if not matches or matches[0][0] != "onnxruntime":
        raise ConfigError(f"{path}: kiln.load() reads .onnx files directly; put other model files in a model "
                          f"folder with a config.pbtxt")
    file_io = read_onnx_io(path)
    config = pb.ModelConfig(name=path.stem, backend="onnxruntime", platform="onnxruntime_onnx")
    for tensor in file_io.inputs:
        config.input.add(name=tensor.name, data_type=_config_type(tensor), dims=tensor.dims)
    for tensor in file_io.outputs:
        config.output.add(name=tensor.name, data_type=_config_type(tensor), dims=tensor.dims)
    return validate_config(config, path.stem, str(path), file_io)


def _config_type(tensor: FileTensor) -> pb.DataType:
    return cast("pb.DataType", tensor.datatype.config_number)
