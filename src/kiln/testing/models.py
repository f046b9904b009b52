"""Small models built in code for tests and examples."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def small_cnn(seed: int = 0) -> onnx.ModelProto:
    """Conv-Relu-Conv-Relu-GlobalAveragePool-Flatten-Gemm on [N, 3, 16, 16]: a classifier INT8 can fuse."""
    rng = np.random.default_rng(seed)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        fan_in = int(np.prod(shape[1:])) or 1
        return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="pool"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "w3", "b3"], ["logits"], name="fc", transB=1),
    ]
    inits = [weight("w1", 16, 3, 3, 3), weight("b1", 16), weight("w2", 16, 16, 3, 3), weight("b2", 16),
             weight("w3", 10, 16), weight("b3", 10)]
    graph = helper.make_graph(
        nodes, "small_cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], inits)
    # IR 8, so an onnxruntime older than the installed onnx still loads it
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
