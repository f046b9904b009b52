"""ONNX graph builders for the small demo models, plus the helpers every demo builder shares."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from itertools import pairwise

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
# IR 8 is the newest IR that onnxruntime 1.16 loads; opset 17 needs no more than that.
IR_VERSION = 8
PRODUCER_NAME = "kiln-demo"
PRODUCER_VERSION = "1"
BATCH_DIM = "batch"

SIMPLE_WIDTH = 16
MLP_SIZES: tuple[int, ...] = (64, 128, 128, 10)


def model_rng(seed: int, model_name: str) -> np.random.Generator:
    """A generator per (seed, model), so adding or reordering models never shifts another model's weights."""
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    return np.random.default_rng([seed, zlib.crc32(model_name.encode())])


def batched_tensor(name: str, elem_type: int, *dims: int) -> onnx.ValueInfoProto:
    """A graph input/output with a symbolic leading batch dimension."""
    return helper.make_tensor_value_info(name, elem_type, [BATCH_DIM, *dims])


def make_demo_model(graph: onnx.GraphProto) -> onnx.ModelProto:
    """Wrap a graph with the fixed opset, IR version and producer every demo model carries."""
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name=PRODUCER_NAME,
        producer_version=PRODUCER_VERSION,
    )
    model.ir_version = IR_VERSION
    return model


def build_simple(elem_type: int = TensorProto.INT32, name: str = "simple") -> onnx.ModelProto:
    """Triton's classic ``simple`` example: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 ([16] of
    ``elem_type``: INT32 for ``simple``, INT8 for ``simple_int8``, which wraps around on overflow)."""
    inputs = [batched_tensor("INPUT0", elem_type, SIMPLE_WIDTH), batched_tensor("INPUT1", elem_type, SIMPLE_WIDTH)]
    outputs = [batched_tensor("OUTPUT0", elem_type, SIMPLE_WIDTH), batched_tensor("OUTPUT1", elem_type, SIMPLE_WIDTH)]
    nodes = [
        helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"], name="add"),
        helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"], name="sub"),
    ]
    return make_demo_model(helper.make_graph(nodes, name, inputs, outputs))


def dense_params(rng: np.random.Generator, fan_in: int, fan_out: int) -> tuple[np.ndarray, np.ndarray]:
    """He-normal weights in torch's [out, in] layout and small uniform biases (as torch.nn.Linear draws them)."""
    weight = rng.standard_normal((fan_out, fan_in), dtype=np.float32) * np.float32(np.sqrt(2.0 / fan_in))
    bound = 1.0 / np.sqrt(fan_in)
    bias = rng.uniform(-bound, bound, fan_out).astype(np.float32)
    return weight, bias


def build_mlp(seed: int = 0, *, sizes: Sequence[int] = MLP_SIZES) -> onnx.ModelProto:
    """An FP32 MLP (Gemm + ReLU layers, logits out); the default is INPUT0 [64] -> 128 -> 128 -> OUTPUT0 [10]."""
    if len(sizes) < 2:
        raise ValueError("an MLP needs at least an input and an output size")
    rng = model_rng(seed, "mlp")
    nodes: list[onnx.NodeProto] = []
    initializers: list[onnx.TensorProto] = []
    last = len(sizes) - 2
    x = "INPUT0"
    for i, (fan_in, fan_out) in enumerate(pairwise(sizes)):
        weight, bias = dense_params(rng, fan_in, fan_out)
        initializers += [numpy_helper.from_array(weight, f"fc{i}.weight"), numpy_helper.from_array(bias, f"fc{i}.bias")]
        y = "OUTPUT0" if i == last else f"fc{i}"
        nodes.append(helper.make_node("Gemm", [x, f"fc{i}.weight", f"fc{i}.bias"], [y], name=f"fc{i}", transB=1))
        if i != last:
            nodes.append(helper.make_node("Relu", [y], [f"relu{i}"], name=f"relu{i}"))
            y = f"relu{i}"
        x = y
    graph = helper.make_graph(
        nodes,
        "mlp",
        [batched_tensor("INPUT0", TensorProto.FLOAT, sizes[0])],
        [batched_tensor("OUTPUT0", TensorProto.FLOAT, sizes[-1])],
        initializer=initializers,
    )
    return make_demo_model(graph)
