"""Inputs and outputs declared by an ONNX model file, for auto-complete and validation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx

from kiln.errors import ConfigError
from kiln.tensor import DataType

_ONNX_TYPES: dict[int, DataType] = {
    onnx.TensorProto.BOOL: DataType.BOOL,
    onnx.TensorProto.UINT8: DataType.UINT8,
    onnx.TensorProto.UINT16: DataType.UINT16,
    onnx.TensorProto.UINT32: DataType.UINT32,
    onnx.TensorProto.UINT64: DataType.UINT64,
    onnx.TensorProto.INT8: DataType.INT8,
    onnx.TensorProto.INT16: DataType.INT16,
    onnx.TensorProto.INT32: DataType.INT32,
    onnx.TensorProto.INT64: DataType.INT64,
    onnx.TensorProto.FLOAT16: DataType.FP16,
    onnx.TensorProto.FLOAT: DataType.FP32,
    onnx.TensorProto.DOUBLE: DataType.FP64,
    onnx.TensorProto.BFLOAT16: DataType.BF16,
    onnx.TensorProto.STRING: DataType.BYTES,
}


@dataclass(frozen=True)
class FileTensor:
    """A tensor as the model file declares it: full dims including any batch dimension; -1 = dynamic."""

    name: str
    datatype: DataType
    dims: tuple[int, ...]


@dataclass(frozen=True)
class FileIO:
    inputs: tuple[FileTensor, ...]
    outputs: tuple[FileTensor, ...]

    def supports_batching(self) -> bool:
        """True when every input and output has a dynamic leading dimension (Triton's rule)."""
        tensors = self.inputs + self.outputs
        return bool(tensors) and all(t.dims and t.dims[0] == -1 for t in tensors)


def onnx_model_path(path: Path) -> Path:
    """``model.onnx`` may be a folder holding ``model.onnx`` plus external data (Triton allows this)."""
    return path / "model.onnx" if path.is_dir() else path


def read_onnx_io(path: Path) -> FileIO:
    file = onnx_model_path(path)
    try:
        model = onnx.load(str(file), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError, OSError, ...; all mean the same thing here
        raise ConfigError(f"{file}: cannot read the ONNX model ({type(exc).__name__}: {exc})") from None
    initializers = {init.name for init in model.graph.initializer}
    inputs = tuple(_tensor(v, file) for v in model.graph.input if v.name not in initializers)
    outputs = tuple(_tensor(v, file) for v in model.graph.output)
    return FileIO(inputs, outputs)


def _tensor(value: onnx.ValueInfoProto, file: Path) -> FileTensor:
    tensor_type = value.type.tensor_type
    if not value.type.HasField("tensor_type"):
        raise ConfigError(f"{file}: '{value.name}' is not a tensor; kiln serves tensor inputs and outputs only")
    datatype = _ONNX_TYPES.get(tensor_type.elem_type)
    if datatype is None:
        name = onnx.TensorProto.DataType.Name(tensor_type.elem_type)
        raise ConfigError(f"{file}: tensor '{value.name}' has ONNX type {name}, which kiln cannot serve")
    dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1 for d in tensor_type.shape.dim)
    return FileTensor(value.name, datatype, dims)
