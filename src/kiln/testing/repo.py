"""Tiny ONNX models built in code, and a writer for the Triton repository layout.

The models carry opset 17 and IR version 8, which every supported onnxruntime loads. Tensor names follow
Triton's ``simple`` example: ``INPUT0``, ``INPUT1``, ... in and ``OUTPUT0``, ``OUTPUT1``, ... out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from kiln.tensor import DataType

OPSET = 17
IR_VERSION = 8
BATCH_DIM = "batch"
"""The symbolic name of the leading batch dimension (``batch=True``); ONNX readers see it as dynamic (-1)."""

_ONNX_TYPES: dict[DataType, int] = {
    DataType.BOOL: TensorProto.BOOL,
    DataType.UINT8: TensorProto.UINT8,
    DataType.UINT16: TensorProto.UINT16,
    DataType.UINT32: TensorProto.UINT32,
    DataType.UINT64: TensorProto.UINT64,
    DataType.INT8: TensorProto.INT8,
    DataType.INT16: TensorProto.INT16,
    DataType.INT32: TensorProto.INT32,
    DataType.INT64: TensorProto.INT64,
    DataType.FP16: TensorProto.FLOAT16,
    DataType.FP32: TensorProto.FLOAT,
    DataType.FP64: TensorProto.DOUBLE,
    DataType.BF16: TensorProto.BFLOAT16,
    DataType.BYTES: TensorProto.STRING,
}

Dim = int | str | None
"""One ONNX dimension: a size, a symbolic name, or None (unnamed, dynamic)."""


def onnx_type(datatype: DataType) -> int:
    """The ONNX ``TensorProto`` element type of a kiln :class:`~kiln.tensor.DataType` (BYTES is STRING)."""
    return _ONNX_TYPES[datatype]


def _value(name: str, datatype: DataType, dims: Sequence[Dim], batch: bool) -> onnx.ValueInfoProto:
    shape: list[Dim] = [BATCH_DIM, *dims] if batch else list(dims)
    return helper.make_tensor_value_info(name, onnx_type(datatype), shape)


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="kiln-testing")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def onnx_add_sub_model(dtype: DataType = DataType.FP32, dims: Sequence[Dim] = (4,), batch: bool = True,
                       name: str = "add_sub") -> onnx.ModelProto:
    """``OUTPUT0 = INPUT0 + INPUT1`` and ``OUTPUT1 = INPUT0 - INPUT1``, all of type ``dtype``.

    ``dims`` is each tensor's shape without the batch dimension; ``batch=True`` prepends a dynamic one.
    """
    inputs = [_value(f"INPUT{i}", dtype, dims, batch) for i in range(2)]
    outputs = [_value(f"OUTPUT{i}", dtype, dims, batch) for i in range(2)]
    nodes = [
        helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"], name="add"),
        helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"], name="sub"),
    ]
    return _model(helper.make_graph(nodes, name, inputs, outputs))


def onnx_identity_model(dtype: DataType = DataType.FP32, dims: Sequence[Dim] = (4,), batch: bool = True,
                        count: int = 1, name: str = "identity") -> onnx.ModelProto:
    """``OUTPUTi = INPUTi`` for ``i < count`` through ONNX Identity nodes (any type, including BYTES)."""
    inputs = [_value(f"INPUT{i}", dtype, dims, batch) for i in range(count)]
    outputs = [_value(f"OUTPUT{i}", dtype, dims, batch) for i in range(count)]
    nodes = [helper.make_node("Identity", [f"INPUT{i}"], [f"OUTPUT{i}"], name=f"identity{i}") for i in range(count)]
    return _model(helper.make_graph(nodes, name, inputs, outputs))


def write_model(repo: Path, name: str, model: onnx.ModelProto | None = None, config: str | None = None,
                versions: Iterable[int] = (1,), filename: str = "model.onnx") -> Path:
    """Write ``<repo>/<name>/config.pbtxt`` (when ``config`` is given) and ``<repo>/<name>/<v>/<filename>``.

    Every version folder in ``versions`` is created; it holds the model file when ``model`` is given. Returns
    the model folder.
    """
    folder = Path(repo) / name
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "config.pbtxt").write_text(config, encoding="utf-8")
    data = model.SerializeToString() if model is not None else None
    for version in versions:
        version_folder = folder / str(version)
        version_folder.mkdir(exist_ok=True)
        if data is not None:
            (version_folder / filename).write_bytes(data)
    return folder


def make_repo(root: Path, **models: onnx.ModelProto | tuple[onnx.ModelProto | None, str | None]) -> Path:
    """Write one model folder (version 1) per keyword argument and return ``root``.

    A value is a model (auto-completed, no config.pbtxt) or a ``(model, config_text)`` pair.
    """
    for name, entry in models.items():
        model, config = entry if isinstance(entry, tuple) else (entry, None)
        write_model(root, name, model, config)
    return Path(root)
