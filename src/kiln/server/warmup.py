"""Run a model's ``model_warmup`` samples on every instance before it takes traffic."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.config.spec import ModelSpec
from kiln.engines.base import Engine
from kiln.errors import ConfigError
from kiln.tensor import DataType, element_count
from kiln.v2._generated import model_config_pb2 as pb


def warm_up(spec: ModelSpec, model_path: Path, engines: list[Engine]) -> None:
    for sample in spec.config.model_warmup:
        inputs = {name: _tensor(spec, model_path, sample, name, value) for name, value in sample.inputs.items()}
        outputs = [t.name for t in spec.outputs]
        for engine in engines:
            for _ in range(max(1, sample.count)):
                engine.execute(inputs, outputs)


def _tensor(spec: ModelSpec, model_path: Path, sample: pb.ModelWarmup, name: str,
            value: pb.ModelWarmup.Input) -> npt.NDArray[Any]:
    datatype = DataType.from_config(value.data_type)
    dims = tuple(int(d) for d in value.dims)
    shape = ((max(1, sample.batch_size),) + dims) if spec.batching else dims
    choice = value.WhichOneof("input_data_type")
    if choice == "input_data_file":
        return _from_file(spec, model_path / "warmup" / value.input_data_file, datatype, shape, sample.name)
    if datatype is DataType.BYTES:
        array = np.empty(element_count(shape), dtype=object)
        array[:] = [b"" for _ in range(array.size)]
        return array.reshape(shape)
    if choice == "random_data":
        rng = np.random.default_rng(0)
        return rng.integers(0, 2, size=shape).astype(datatype.numpy_dtype)
    return np.zeros(shape, dtype=datatype.numpy_dtype)


def _from_file(spec: ModelSpec, path: Path, datatype: DataType, shape: tuple[int, ...],
               sample: str) -> npt.NDArray[Any]:
    if not path.is_file():
        raise ConfigError(f"model '{spec.name}': warmup '{sample}' reads {path}, which does not exist; "
                          f"put the file in the model's warmup/ folder")
    data = path.read_bytes()
    size = datatype.byte_size
    if size is None or len(data) != size * element_count(shape):
        raise ConfigError(f"model '{spec.name}': warmup '{sample}' file {path} has {len(data)} bytes; expected "
                          f"{(size or 0) * element_count(shape)} for {datatype.wire_name} {list(shape)}")
    return np.frombuffer(data, dtype=datatype.numpy_dtype).reshape(shape)
