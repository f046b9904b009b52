"""Pre-flight: unsupported_nodes() lists every node the converter cannot handle, and convert() refuses with one
UnsupportedError naming them all."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kiln.build.torch_convert import convert, unsupported_nodes
from kiln.errors import ErrorCode, InvalidArgumentError, UnsupportedError


def _model(nodes: list[onnx.NodeProto], initializers: dict[str, np.ndarray] | None = None, opset: int = 17,
           inputs: tuple[str, ...] = ("x",), outputs: tuple[str, ...] = ("y",)) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "preflight", [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", 4, 8, 8]) for n in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        [numpy_helper.from_array(v, k) for k, v in (initializers or {}).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _mixed_model() -> onnx.ModelProto:
    """Supported nodes around six unsupported ones, each for a different reason."""
    w = np.ones((4, 4, 3, 3), np.float32)
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="ok_relu"),
        helper.make_node("Conv", ["r", "w"], ["c"], name="conv_same_s2", auto_pad="SAME_UPPER", strides=[2, 2]),
        helper.make_node("FancyOp", ["c"], ["f"], name="custom", domain="com.example"),
        helper.make_node("Einsum", ["f"], ["e"], name="einsum", equation="ij->ji"),
        helper.make_node("Shape", ["x"], ["shape"], name="shape_of_x"),
        helper.make_node("Reshape", ["e", "shape"], ["rs"], name="reshape_runtime_shape"),
        helper.make_node("MaxPool", ["rs"], ["mp", "idx"], name="pool_with_indices", kernel_shape=[2, 2]),
        helper.make_node("Pad", ["mp", "pads"], ["y"], name="pad_reflect", mode="reflect"),
    ]
    return _model(nodes, {"w": w, "pads": np.zeros(8, np.int64)})


def test_unsupported_nodes_lists_each_node_with_op_domain_and_reason() -> None:
    found = unsupported_nodes(_mixed_model())
    assert [(n.name, n.op_type, n.domain, n.index) for n in found] == [
        ("conv_same_s2", "Conv", "ai.onnx", 1),
        ("custom", "FancyOp", "com.example", 2),
        ("einsum", "Einsum", "ai.onnx", 3),
        ("shape_of_x", "Shape", "ai.onnx", 4),
        ("reshape_runtime_shape", "Reshape", "ai.onnx", 5),
        ("pool_with_indices", "MaxPool", "ai.onnx", 6),
        ("pad_reflect", "Pad", "ai.onnx", 7),
    ]
    reasons = [n.reason for n in found]
    assert "auto_pad=SAME_UPPER with strides [2, 2]" in reasons[0]
    assert "domain 'com.example'" in reasons[1]
    assert "no rule for Einsum" in reasons[2]
    assert "no rule for Shape" in reasons[3]
    assert "the shape (input 'shape') must be a constant" in reasons[4]
    assert "Indices output (output 'idx')" in reasons[5]
    assert "mode='reflect'" in reasons[6]


def test_convert_raises_one_unsupported_error_naming_every_node() -> None:
    with pytest.raises(UnsupportedError) as info:
        convert(_mixed_model())
    message = str(info.value)
    assert info.value.code is ErrorCode.UNSUPPORTED
    assert message.startswith("ONNX graph 'preflight': 7 node(s) cannot be converted to PyTorch")
    for label in ("conv_same_s2 (Conv)", "custom (FancyOp)", "einsum (Einsum)", "shape_of_x (Shape)",
                  "reshape_runtime_shape (Reshape)", "pool_with_indices (MaxPool)", "pad_reflect (Pad)"):
        assert label in message
    assert "ok_relu" not in message


def test_supported_model_has_no_unsupported_nodes() -> None:
    model = _model([helper.make_node("Relu", ["x"], ["y"])])
    assert unsupported_nodes(model) == []


@pytest.mark.parametrize("opset", [10, 22])
def test_opset_outside_11_to_21_is_reported_once_for_all_nodes(opset: int) -> None:
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="a"), helper.make_node("Neg", ["r"], ["y"])]
    found = unsupported_nodes(_model(nodes, opset=opset))
    assert [n.label for n in found] == ["a (Relu)", "#1 (Neg)"]
    assert all(f"uses ai.onnx opset {opset}; supported opsets are 11-21" in n.reason for n in found)
    with pytest.raises(UnsupportedError, match=r"a \(Relu\), #1 \(Neg\): the model uses ai.onnx opset"):
        convert(_model(nodes, opset=opset))


def test_operator_newer_than_the_model_opset_is_reported() -> None:
    (found,) = unsupported_nodes(_model([helper.make_node("Gelu", ["x"], ["y"])], opset=17))
    assert found.reason == "Gelu is not an ai.onnx operator at opset 17"


def test_nodes_out_of_topological_order_are_reported() -> None:
    nodes = [helper.make_node("Relu", ["r"], ["y"], name="late"), helper.make_node("Neg", ["x"], ["r"])]
    (found,) = unsupported_nodes(_model(nodes))
    assert found.name == "late" and "input 'r' is not a graph input" in found.reason


def test_attribute_and_input_limits_are_reported() -> None:
    w = np.ones((4, 4, 3, 3), np.float32)
    nodes = [
        helper.make_node("ConvTranspose", ["x", "w"], ["a"], name="ct", output_shape=[16, 16]),
        helper.make_node("AveragePool", ["x"], ["b"], name="ap", kernel_shape=[2, 2], dilations=[2, 2]),
        helper.make_node("Clip", ["x", "lo"], ["c"], name="clip"),
        helper.make_node("Cast", ["x"], ["d"], name="cast", to=TensorProto.STRING),
        helper.make_node("Resize", ["x", "", "scales"], ["e"], name="resize", mode="cubic"),
        helper.make_node("BatchNormalization", ["x", "s", "s", "s", "s"], ["y"], name="bn", training_mode=1),
    ]
    model = _model(nodes, {"w": w, "scales": np.ones(4, np.float32), "s": np.ones(4, np.float32)},
                   inputs=("x", "lo"))
    reasons = {n.name: n.reason for n in unsupported_nodes(model)}
    assert "output_shape attribute" in reasons["ct"]
    assert "dilations [2, 2]" in reasons["ap"]
    assert "min (input 'lo') must be a constant" in reasons["clip"]
    assert "Cast to STRING is not supported" in reasons["cast"]
    assert "mode 'cubic' is not supported" in reasons["resize"]
    assert "training_mode=1" in reasons["bn"]


def test_external_data_that_was_not_loaded_is_reported(tmp_path: Path) -> None:
    model = _model([helper.make_node("Mul", ["x", "w"], ["y"], name="scale")], {"w": np.ones(8, np.float32)})
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, size_threshold=0)
    (found,) = unsupported_nodes(onnx.load(str(tmp_path / "m.onnx"), load_external_data=False))
    assert found.name == "scale" and "external file that was not loaded" in found.reason
    assert unsupported_nodes(onnx.load(str(tmp_path / "m.onnx"))) == []


def test_constant_subgraphs_are_folded_so_their_results_count_as_constants() -> None:
    nodes = [
        helper.make_node("Constant", [], ["batch_dim"], value_ints=[0]),
        helper.make_node("Unsqueeze", ["minus_one", "axes"], ["rest"]),
        helper.make_node("Concat", ["batch_dim", "rest"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    model = _model(nodes, {"minus_one": np.array(-1, np.int64), "axes": np.array([0], np.int64)})
    assert unsupported_nodes(model) == []
    x = np.random.default_rng(0).standard_normal((2, 4, 8, 8)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, {"x": x})
    (got,) = convert(model)(torch.from_numpy(x))
    assert got.shape == (2, 256)
    np.testing.assert_array_equal(got.numpy(), expected)
    assert list(convert(model).state_dict()) == []  # the shape was read at conversion time, not kept as a weight


def test_a_constant_node_that_fails_to_evaluate_is_reported_not_raised() -> None:
    nodes = [helper.make_node("Reshape", ["c", "shape"], ["bad"], name="bad_reshape"),
             helper.make_node("Add", ["x", "bad"], ["y"])]
    found = unsupported_nodes(_model(nodes, {"c": np.ones(6, np.float32), "shape": np.array([4], np.int64)}))
    assert [n.name for n in found] == ["bad_reshape"]
    assert "evaluating the node on its constant inputs failed" in found[0].reason


def test_graph_output_nobody_produces_is_an_invalid_argument() -> None:
    model = _model([helper.make_node("Relu", ["x"], ["y"])], outputs=("y", "missing"))
    with pytest.raises(InvalidArgumentError, match="value 'missing' is used but no graph input"):
        convert(model)


def test_convert_wants_a_model_proto(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"expected an onnx.ModelProto, got PosixPath.*onnx.load\(path\)"):
        convert(tmp_path / "m.onnx")  # type: ignore[arg-type]
