"""Every operator rule against ONNX Runtime: a one-node model per case, run in both, compared element-wise."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kiln.build.torch_convert import SUPPORTED_OPS, convert

RNG = np.random.default_rng(7)
INT_MAX = np.iinfo(np.int64).max
INT_MIN = np.iinfo(np.int64).min
TESTED_OPS: set[str] = set()


def f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def pos(*shape: int) -> np.ndarray:
    return RNG.uniform(0.1, 3.0, shape).astype(np.float32)


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def case(op: str, feeds: dict[str, np.ndarray], consts: dict[str, np.ndarray] | None = None, *,
         order: list[str] | None = None, opset: int = 17, outputs: int = 1, out_type: int | None = None,
         id: str = "", **attrs: Any) -> Any:
    """A pytest param holding a one-node model (inputs: ``order`` or feeds then consts) and its feeds."""
    TESTED_OPS.add(op)
    consts = consts or {}
    names = order if order is not None else [*feeds, *consts]
    first = next(iter({**feeds, **consts}.values()))
    elem = out_type if out_type is not None else helper.np_dtype_to_tensor_dtype(first.dtype)
    outs = [f"y{i}" for i in range(outputs)]
    graph = helper.make_graph(
        [helper.make_node(op, names, outs, name=f"{op.lower()}_node", **attrs)], f"one_{op}",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape) for n, a in feeds.items()],
        [helper.make_tensor_value_info(n, elem, None) for n in outs],
        [numpy_helper.from_array(a, n) for n, a in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10 if opset > 20 else 8)
    return pytest.param(model, feeds, id=f"{op}-{id}" if id else op)


CASES = [
    # element-wise, with broadcasting
    case("Add", {"a": f32(2, 3, 4), "b": f32(4)}),
    case("Add", {"a": i64(1, -2, 3), "b": i64(5, 6, 7)}, id="int64"),
    case("Sub", {"a": f32(2, 3, 4), "b": f32(3, 1)}),
    case("Mul", {"a": f32(2, 3), "b": f32(2, 3)}),
    case("Div", {"a": f32(2, 3), "b": pos(3)}),
    case("Div", {"a": np.array([7, -7, 9, -9], np.int32), "b": np.array([2, 2, -4, -4], np.int32)}, id="int-trunc"),
    case("Pow", {"a": pos(2, 3), "b": f32(2, 3)}),
    case("Pow", {"a": f32(2, 3)}, {"e": np.array(3, np.int64)}, id="int-exponent"),
    case("Sqrt", {"x": pos(2, 5)}),
    case("Exp", {"x": f32(2, 5)}),
    case("Log", {"x": pos(2, 5)}),
    case("Neg", {"x": f32(2, 5)}),
    case("Abs", {"x": f32(2, 5)}),
    case("Relu", {"x": f32(2, 5)}),
    case("Sigmoid", {"x": f32(2, 5)}),
    case("Tanh", {"x": f32(2, 5)}),
    case("Erf", {"x": f32(2, 5)}),
    case("LeakyRelu", {"x": f32(2, 5)}, id="default"),
    case("LeakyRelu", {"x": f32(2, 5)}, alpha=0.3, id="alpha"),
    case("HardSigmoid", {"x": 4 * f32(3, 5)}, alpha=0.3, beta=0.4),
    case("HardSwish", {"x": 4 * f32(3, 5)}),
    case("Gelu", {"x": f32(3, 5)}, opset=20, id="exact"),
    case("Gelu", {"x": f32(3, 5)}, opset=20, approximate="tanh", id="tanh"),
    case("Clip", {"x": f32(3, 5)}, {"lo": np.array(-0.5, np.float32), "hi": np.array(0.7, np.float32)}),
    case("Clip", {"x": f32(3, 5)}, {"hi": np.array(0.2, np.float32)}, order=["x", "", "hi"], opset=11, id="max-only"),
    case("Clip", {"x": f32(3, 5)}, id="no-bounds"),
    case("Clip", {"x": np.arange(-5, 5, dtype=np.int32)}, {"lo": np.array(-2, np.int32), "hi": np.array(3, np.int32)},
         id="int32"),
    # Softmax: opset < 13 normalizes over the flattened trailing axes, opset >= 13 over one axis
    case("Softmax", {"x": f32(2, 3, 4)}, opset=11, id="opset11-default"),
    case("Softmax", {"x": f32(2, 3, 4)}, opset=11, axis=2, id="opset11-axis2"),
    case("Softmax", {"x": f32(2, 3, 4)}, opset=13, id="opset13-default"),
    case("Softmax", {"x": f32(2, 3, 4)}, opset=13, axis=1, id="opset13-axis1"),
    case("LogSoftmax", {"x": f32(2, 3, 4)}, opset=12, axis=0, id="opset12-axis0"),
    case("LogSoftmax", {"x": f32(2, 3, 4)}, opset=13, axis=-2, id="opset13"),
    case("Cast", {"x": 5 * f32(2, 4)}, to=TensorProto.INT32, out_type=TensorProto.INT32, id="to-int32"),
    case("Cast", {"x": np.array([-3, 0, 7], np.int64)}, to=TensorProto.FLOAT, out_type=TensorProto.FLOAT,
         id="to-float"),
    case("Cast", {"x": f32(2, 4)}, to=TensorProto.FLOAT16, out_type=TensorProto.FLOAT16, id="to-float16"),
    case("Cast", {"x": np.array([0.0, 0.5, -2.0], np.float32)}, to=TensorProto.BOOL, out_type=TensorProto.BOOL,
         id="to-bool"),
    case("Identity", {"x": f32(2, 3)}),
    case("Dropout", {"x": f32(2, 3)}, opset=11, ratio=0.5, id="opset11"),
    case("Dropout", {"x": f32(2, 3)}, {"r": np.array(0.3, np.float32), "t": np.array(False)}, opset=13,
         id="training-false"),
    # Conv family
    case("Conv", {"x": f32(2, 3, 7, 7)}, {"w": f32(4, 3, 3, 3), "b": f32(4)}, pads=[1, 1, 1, 1], id="2d"),
    case("Conv", {"x": f32(1, 4, 9, 8)}, {"w": f32(6, 2, 3, 2)}, group=2, strides=[2, 1], dilations=[2, 1],
         id="groups-strides-dilations"),
    case("Conv", {"x": f32(1, 2, 6, 6)}, {"w": f32(3, 2, 3, 3)}, pads=[0, 1, 2, 1], id="asymmetric-pads"),
    case("Conv", {"x": f32(1, 2, 6, 6)}, {"w": f32(3, 2, 2, 2)}, auto_pad="SAME_UPPER", id="same-upper"),
    case("Conv", {"x": f32(1, 2, 6, 6)}, {"w": f32(3, 2, 2, 4)}, auto_pad="SAME_LOWER", id="same-lower"),
    case("Conv", {"x": f32(1, 2, 6, 6)}, {"w": f32(3, 2, 3, 3)}, auto_pad="VALID", strides=[2, 2], id="valid"),
    case("Conv", {"x": f32(2, 3, 10)}, {"w": f32(5, 3, 3), "b": f32(5)}, pads=[2, 1], id="1d"),
    case("Conv", {"x": f32(1, 2, 5, 5, 5)}, {"w": f32(3, 2, 3, 3, 3)}, pads=[1, 0, 1, 1, 0, 1], id="3d"),
    case("Conv", {"x": f32(1, 2, 5, 5), "w": f32(3, 2, 3, 3)}, kernel_shape=[3, 3], id="runtime-weight"),
    case("ConvTranspose", {"x": f32(1, 3, 4, 4)}, {"w": f32(3, 2, 3, 3), "b": f32(2)}, strides=[2, 2],
         pads=[1, 1, 1, 1], output_padding=[1, 1], id="2d"),
    case("ConvTranspose", {"x": f32(1, 4, 4, 5)}, {"w": f32(4, 1, 3, 2)}, group=2, strides=[2, 1],
         pads=[0, 1, 2, 0], id="asymmetric-groups"),
    case("ConvTranspose", {"x": f32(1, 2, 5)}, {"w": f32(2, 3, 4), "b": f32(3)}, strides=[3], dilations=[2],
         output_padding=[2], pads=[1, 0], id="1d-output-padding"),
    case("Gemm", {"a": f32(3, 4)}, {"b": f32(5, 4), "c": f32(5)}, transB=1, id="linear"),
    case("Gemm", {"a": f32(4, 3), "b": f32(4, 5)}, {"c": f32(3, 1)}, transA=1, alpha=0.5, beta=2.0, id="transA"),
    case("Gemm", {"a": f32(3, 4), "b": f32(4, 5)}, id="no-c"),
    case("Gemm", {"a": f32(3, 4)}, {"b": f32(5, 4), "c": np.array(1.5, np.float32)}, transB=1, beta=0.5,
         id="scalar-c"),
    case("MatMul", {"a": f32(2, 3, 4), "b": f32(4, 5)}),
    case("MatMul", {"a": f32(4), "b": f32(2, 4, 3)}, id="vector"),
    case("BatchNormalization", {"x": f32(2, 3, 4, 4)},
         {"s": f32(3), "b": f32(3), "m": f32(3), "v": pos(3)}, epsilon=1e-3, opset=15, id="opset15"),
    case("BatchNormalization", {"x": f32(4, 3)}, {"s": f32(3), "b": f32(3), "m": f32(3), "v": pos(3)}, opset=11,
         id="2d-opset11"),
    case("LayerNormalization", {"x": f32(2, 3, 8)}, {"s": f32(8), "b": f32(8)}, id="last-axis"),
    case("LayerNormalization", {"x": f32(2, 3, 4)}, {"s": f32(3, 4)}, axis=1, epsilon=1e-3, id="axis1-no-bias"),
    case("LayerNormalization", {"x": f32(2, 3, 4)}, {"s": f32(1, 4), "b": f32(4)}, axis=-2, id="broadcast-scale"),
    # pooling
    case("MaxPool", {"x": f32(2, 3, 8, 8)}, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], id="2d"),
    case("MaxPool", {"x": f32(1, 2, 7, 7)}, kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1, id="ceil"),
    case("MaxPool", {"x": f32(1, 2, 8, 8)}, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1,
         opset=19, id="ceil-pads"),
    case("MaxPool", {"x": f32(1, 2, 5, 5)}, kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1,
         opset=19, id="ceil-last-window-in-pad"),
    case("MaxPool", {"x": f32(1, 2, 7, 7)}, kernel_shape=[3, 3], pads=[0, 2, 2, 1], id="asymmetric-large-pads"),
    case("MaxPool", {"x": f32(1, 2, 9, 9)}, kernel_shape=[2, 3], dilations=[2, 1], id="dilations"),
    case("MaxPool", {"x": f32(1, 2, 9)}, kernel_shape=[3], strides=[2], id="1d"),
    case("MaxPool", {"x": f32(1, 2, 5, 5, 5)}, kernel_shape=[2, 2, 2], id="3d"),
    case("MaxPool", {"x": RNG.integers(0, 255, (1, 2, 6, 6)).astype(np.uint8)}, kernel_shape=[2, 2],
         pads=[0, 0, 1, 1], id="uint8-asymmetric"),
    case("MaxPool", {"x": f32(1, 2, 6, 6)}, kernel_shape=[3, 3], auto_pad="SAME_UPPER", id="same-upper"),
    case("AveragePool", {"x": f32(2, 3, 8, 8)}, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
         id="exclude-pad"),
    case("AveragePool", {"x": f32(2, 3, 8, 8)}, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
         count_include_pad=1, id="include-pad"),
    case("AveragePool", {"x": f32(1, 2, 7, 7)}, kernel_shape=[3, 3], pads=[0, 1, 2, 2], id="asymmetric"),
    case("AveragePool", {"x": f32(1, 2, 7, 7)}, kernel_shape=[3, 3], pads=[0, 1, 2, 2], count_include_pad=1,
         id="asymmetric-include-pad"),
    case("AveragePool", {"x": f32(1, 2, 7, 7)}, kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1, id="ceil"),
    case("AveragePool", {"x": f32(1, 2, 8, 8)}, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1,
         count_include_pad=1, opset=19, id="ceil-include-pad"),
    case("AveragePool", {"x": f32(1, 2, 5, 5)}, kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1,
         opset=19, id="ceil-last-window-in-pad"),
    case("AveragePool", {"x": f32(1, 2, 5, 5)}, kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1,
         count_include_pad=1, opset=11, id="ceil-last-window-in-pad-include-pad"),
    case("AveragePool", {"x": f32(1, 2, 6, 6)}, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1,
         count_include_pad=1, opset=19, id="ceil-window-past-pad-include-pad"),
    case("AveragePool", {"x": f32(1, 2, 9)}, kernel_shape=[4], strides=[3], pads=[2, 2], id="1d"),
    case("AveragePool", {"x": f32(1, 2, 4, 5, 6)}, kernel_shape=[2, 2, 3], strides=[1, 2, 3], id="3d"),
    case("GlobalAveragePool", {"x": f32(2, 3, 5, 4)}),
    case("GlobalAveragePool", {"x": f32(2, 3, 5)}, id="1d"),
    case("GlobalMaxPool", {"x": f32(2, 3, 5, 4)}),
    # layout
    case("Flatten", {"x": f32(2, 3, 4)}, id="default"),
    case("Flatten", {"x": f32(2, 3, 4)}, axis=0, id="axis0"),
    case("Flatten", {"x": f32(2, 3, 4, 5)}, axis=-2, id="axis-negative"),
    case("Flatten", {"x": f32(2, 3, 4)}, axis=3, id="axis-rank"),
    case("Reshape", {"x": f32(2, 3, 4)}, {"s": i64(0, -1)}, id="zero-copies"),
    case("Reshape", {"x": f32(2, 3, 4)}, {"s": i64(4, 0, 2)}, id="zero-middle"),
    case("Reshape", {"x": f32(2, 3, 4)}, {"s": i64(-1)}, allowzero=1, opset=14, id="allowzero"),
    case("Transpose", {"x": f32(2, 3, 4)}, id="reverse"),
    case("Transpose", {"x": f32(2, 3, 4, 5)}, perm=[0, 2, 3, 1], id="perm"),
    case("Concat", {"a": f32(2, 3), "b": f32(2, 1), "c": f32(2, 2)}, axis=1),
    case("Concat", {"a": f32(2, 3)}, {"b": f32(1, 3)}, axis=-2, id="negative-axis"),
    case("Split", {"x": f32(2, 6)}, axis=1, split=[1, 2, 3], opset=11, outputs=3, id="opset11-attr"),
    case("Split", {"x": f32(6, 2)}, {"s": i64(4, 2)}, opset=13, outputs=2, id="opset13-input"),
    case("Split", {"x": f32(2, 6)}, axis=-1, opset=13, outputs=3, id="opset13-equal"),
    case("Split", {"x": f32(2, 5)}, axis=1, num_outputs=2, opset=18, outputs=2, id="opset18-uneven"),
    case("Squeeze", {"x": f32(1, 3, 1, 2)}, axes=[0, -2], opset=11, id="opset11"),
    case("Squeeze", {"x": f32(1, 3, 1, 2)}, {"a": i64(2)}, opset=13, id="opset13"),
    case("Squeeze", {"x": f32(1, 3, 1, 2)}, opset=13, id="all"),
    case("Unsqueeze", {"x": f32(3, 2)}, axes=[0, 3], opset=11, id="opset11"),
    case("Unsqueeze", {"x": f32(3, 2)}, {"a": i64(-1, 1)}, opset=13, id="opset13-negative"),
    case("Slice", {"x": f32(4, 6)}, {"s": i64(1, 0), "e": i64(3, INT_MAX), "a": i64(0, 1), "t": i64(1, 2)},
         id="steps"),
    case("Slice", {"x": f32(4, 6)}, {"s": i64(-2), "e": i64(-7), "a": i64(-1), "t": i64(-2)}, id="negative-step"),
    case("Slice", {"x": f32(4, 6)}, {"s": i64(INT_MAX), "e": i64(INT_MIN), "a": i64(0), "t": i64(-1)},
         id="reverse-all"),
    case("Slice", {"x": f32(4, 6)}, {"s": i64(5, -10), "e": i64(1, 3)}, id="clamped"),
    case("Slice", {"x": f32(3, 4, 6)}, {"s": i64(1, -4), "e": i64(2, 100), "a": i64(-2, -1)}, id="negative-axes"),
    case("Pad", {"x": f32(2, 3, 4)}, {"p": i64(0, 1, 2, 0, 2, 1), "v": np.array(1.5, np.float32)}, opset=11),
    case("Pad", {"x": f32(2, 3, 4)}, {"p": i64(0, -1, 1, 0, 0, -2)}, opset=13, id="negative-crops"),
    case("Pad", {"x": f32(2, 3, 4)}, {"p": i64(1, 2, 3, 0), "v": np.array(-1.0, np.float32), "a": i64(-1, 1)},
         opset=18, id="axes"),
    case("Pad", {"x": np.arange(6, dtype=np.int32).reshape(2, 3)}, {"p": i64(1, 0, 0, 1)}, opset=13, id="int32"),
    # reductions
    case("ReduceMean", {"x": f32(2, 3, 4)}, axes=[1], opset=11, id="opset11"),
    case("ReduceMean", {"x": f32(2, 3, 4)}, {"a": i64(0, -1)}, keepdims=0, opset=18, id="opset18"),
    case("ReduceMean", {"x": f32(2, 3, 4)}, opset=18, id="all"),
    case("ReduceMean", {"x": np.array([[1, 2, 4], [-3, -4, 5]], np.int32)}, axes=[1], opset=13, id="int32"),
    case("ReduceSum", {"x": f32(2, 3, 4)}, axes=[0, 2], keepdims=0, opset=11, id="opset11"),
    case("ReduceSum", {"x": f32(2, 3, 4)}, {"a": i64(1)}, opset=13, id="opset13"),
    case("ReduceSum", {"x": f32(2, 3, 4)}, opset=13, noop_with_empty_axes=1, id="noop"),
    case("ReduceSum", {"x": np.arange(12, dtype=np.int32).reshape(3, 4)}, opset=13, keepdims=0, id="int32-all"),
    case("ReduceMax", {"x": f32(2, 3, 4)}, axes=[-1], opset=13, id="opset13"),
    case("ReduceMax", {"x": f32(2, 3, 4)}, {"a": i64(0, 1)}, keepdims=0, opset=18, id="opset18"),
    # Resize (the simple cases)
    case("Resize", {"x": f32(1, 2, 3, 4)}, {"r": np.zeros(0, np.float32), "s": np.array([1, 1, 2, 3], np.float32)},
         mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor", opset=11, id="nearest"),
    case("Resize", {"x": f32(1, 2, 4, 6)}, {"s": np.array([1, 1, 2, 0.5], np.float32)}, order=["x", "", "s"],
         mode="linear", opset=13, id="linear-half-pixel"),
    case("Resize", {"x": f32(1, 2, 4, 6)}, {"s": np.array([1, 1, 1.5, 2], np.float32)}, order=["x", "", "s"],
         mode="linear", coordinate_transformation_mode="align_corners", opset=13, id="linear-align-corners"),
    case("Resize", {"x": f32(1, 2, 5)}, {"s": np.array([1, 1, 2], np.float32)}, order=["x", "", "s"],
         mode="linear", coordinate_transformation_mode="pytorch_half_pixel", opset=19, id="linear-1d"),
]


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [np.asarray(v) for v in session.run(None, feeds)]


def assert_matches_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray], atol: float = 1e-5) -> None:
    expected = _ort(model, feeds)
    module = convert(model)
    with torch.no_grad():
        got = module(*[torch.from_numpy(a) for a in feeds.values()])
    assert isinstance(got, tuple) and len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.numpy().dtype == e.dtype
        assert g.shape == e.shape
        np.testing.assert_allclose(g.numpy(), e, atol=atol, rtol=1e-5)


@pytest.mark.parametrize(("model", "feeds"), CASES)
def test_op_matches_onnxruntime(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    assert_matches_ort(model, feeds)


def test_every_supported_op_has_a_case() -> None:
    assert SUPPORTED_OPS - TESTED_OPS == {"Constant"}  # Constant needs a consumer: tested below


def test_constant_nodes_feed_later_nodes() -> None:
    nodes = [
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(f32(3), "c")),
        helper.make_node("Constant", [], ["k"], value_float=2.5),
        helper.make_node("Constant", [], ["shape"], value_ints=[-1]),
        helper.make_node("Add", ["x", "c"], ["s"]),
        helper.make_node("Mul", ["s", "k"], ["m"]),
        helper.make_node("Reshape", ["m", "shape"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "constants", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert_matches_ort(model, {"x": f32(2, 3)})
