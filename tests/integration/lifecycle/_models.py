"""Tiny ONNX models whose answers say which version produced them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

CONFIG = """
name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
dynamic_batching {{ }}
instance_group [ {{ kind: KIND_CPU count: {count} }} ]
"""


def add_model(constant: float) -> onnx.ModelProto:
    """y = x + constant: a response's values identify the version that computed it."""
    const = numpy_helper.from_array(np.full((4,), constant, np.float32), "c")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "c"], ["y"])], "add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], [const])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="kiln-test")
    model.ir_version = 8
    return model


def write_version(model_path: Path, version: int, constant: float | None = None) -> Path:
    folder = model_path / str(version)
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder / ".model.onnx.tmp"
    staging.write_bytes(add_model(float(version) if constant is None else constant).SerializeToString())
    staging.replace(folder / "model.onnx")
    return folder


def write_model(repo: Path, name: str, versions: list[int], count: int = 1, extra: str = "") -> Path:
    path = repo / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.pbtxt").write_text(CONFIG.format(name=name, count=count) + extra)
    for version in versions:
        write_version(path, version)
    return path
