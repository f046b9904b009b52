"""Whole graphs through the converter: the demo MLP, a small ResNet and a layout-heavy graph, compared with ONNX
Runtime at batch 1 and 4 in eager mode, after torch.jit.trace and after torch.export with a dynamic batch axis."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kiln.build.torch_convert import convert
from kiln.demo.models import build_mlp, build_simple
from kiln.demo.resnet import build_resnet50

INT_MAX = np.iinfo(np.int64).max
INT_MIN = np.iinfo(np.int64).min
RNG = np.random.default_rng(3)
BATCHES = (1, 4)
Runner = Callable[..., tuple[torch.Tensor, ...]]


def _layout_model() -> onnx.ModelProto:
    """Shape-manipulating operators chained behind a dynamic batch axis (opset 18 input-style axes)."""
    consts = {
        "scales": np.array([1, 1, 2, 2], np.float32), "s_start": np.array([-1], np.int64),
        "s_end": np.array([INT_MIN], np.int64), "s_axes": np.array([3], np.int64), "s_steps": np.array([-1], np.int64),
        "pads": np.array([0, 0, 0, 1, 0, 0, 0, 1], np.int64), "ln_scale": RNG.standard_normal(4).astype(np.float32),
        "ln_bias": RNG.standard_normal(4).astype(np.float32), "shape": np.array([0, -1, 4], np.int64),
        "ax1": np.array([1], np.int64),
    }
    nodes = [
        helper.make_node("Resize", ["x", "", "scales"], ["up"], mode="nearest",
                         coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
        helper.make_node("MaxPool", ["up"], ["pool"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Slice", ["pool", "s_start", "s_end", "s_axes", "s_steps"], ["rev"]),
        helper.make_node("Pad", ["rev", "pads"], ["padded"]),
        helper.make_node("Transpose", ["padded"], ["nhwc"], perm=[0, 2, 3, 1]),
        helper.make_node("LayerNormalization", ["nhwc", "ln_scale", "ln_bias"], ["norm"]),
        helper.make_node("Reshape", ["norm", "shape"], ["rows"]),
        helper.make_node("Split", ["rows"], ["a", "b"], axis=1, num_outputs=2),
        helper.make_node("Concat", ["b", "a"], ["cat"], axis=2),
        helper.make_node("Unsqueeze", ["cat", "ax1"], ["u"]),
        helper.make_node("Squeeze", ["u", "ax1"], ["sq"]),
        helper.make_node("Softmax", ["sq"], ["sm"], axis=-1),
        helper.make_node("ReduceMean", ["sm", "ax1"], ["mean"], keepdims=0),
        helper.make_node("Flatten", ["cat"], ["flat"], axis=1),
    ]
    graph = helper.make_graph(
        nodes, "layout", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 6, 6])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("mean", "flat")],
        [numpy_helper.from_array(v, k) for k, v in consts.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


class _ResNetBuilder:
    """A two-block ResNet-style graph with explicit BatchNormalization nodes (the demo ResNet folds them away)."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.weights: list[onnx.TensorProto] = []

    def _param(self, name: str, array: np.ndarray) -> str:
        self.weights.append(numpy_helper.from_array(array.astype(np.float32), name))
        return name

    def conv_bn(self, name: str, x: str, c_in: int, c_out: int, kernel: int, stride: int, relu: bool) -> str:
        w = self._param(f"{name}.w", RNG.standard_normal((c_out, c_in, kernel, kernel)) / np.sqrt(c_in * kernel**2))
        pad = kernel // 2
        self.nodes.append(helper.make_node("Conv", [x, w], [f"{name}.conv"], strides=[stride, stride],
                                           pads=[pad] * 4, name=f"{name}.conv"))
        bn = [self._param(f"{name}.bn.{p}", RNG.uniform(0.5, 1.5, c_out) if p in ("scale", "var")
                          else RNG.standard_normal(c_out) * 0.1) for p in ("scale", "bias", "mean", "var")]
        self.nodes.append(helper.make_node("BatchNormalization", [f"{name}.conv", *bn], [f"{name}.bn"],
                                           name=f"{name}.bn"))
        if not relu:
            return f"{name}.bn"
        self.nodes.append(helper.make_node("Relu", [f"{name}.bn"], [f"{name}.relu"], name=f"{name}.relu"))
        return f"{name}.relu"

    def block(self, name: str, x: str, c_in: int, c_out: int, stride: int) -> str:
        y = self.conv_bn(f"{name}.a", x, c_in, c_out, 3, stride, relu=True)
        y = self.conv_bn(f"{name}.b", y, c_out, c_out, 3, 1, relu=False)
        shortcut = x if stride == 1 and c_in == c_out else self.conv_bn(f"{name}.down", x, c_in, c_out, 1, stride,
                                                                        relu=False)
        self.nodes.append(helper.make_node("Add", [y, shortcut], [f"{name}.add"], name=f"{name}.add"))
        self.nodes.append(helper.make_node("Relu", [f"{name}.add"], [f"{name}.out"], name=f"{name}.out"))
        return f"{name}.out"

    def build(self) -> onnx.ModelProto:
        x = self.conv_bn("stem", "image", 3, 8, 3, 2, relu=True)
        self.nodes.append(helper.make_node("MaxPool", [x], ["pool"], kernel_shape=[3, 3], strides=[2, 2],
                                           pads=[1, 1, 1, 1], name="pool"))
        x = self.block("layer2", self.block("layer1", "pool", 8, 8, 1), 8, 16, 2)
        fc_w, fc_b = self._param("fc.w", RNG.standard_normal((10, 16)) * 0.3), self._param("fc.b", RNG.random(10))
        self.nodes += [helper.make_node("GlobalAveragePool", [x], ["gap"], name="gap"),
                       helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
                       helper.make_node("Gemm", ["flat", fc_w, fc_b], ["logits"], transB=1, name="fc")]
        graph = helper.make_graph(
            self.nodes, "small_resnet", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["n", 3, 16, 16])],
            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 10])], self.weights)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


MODELS = {
    "mlp": (build_mlp, (64,)),
    "small-resnet": (lambda: _ResNetBuilder().build(), (3, 16, 16)),
    "layout": (_layout_model, (4, 6, 6)),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_case(request: pytest.FixtureRequest) -> tuple[onnx.ModelProto, torch.nn.Module, dict[int, np.ndarray],
                                                        dict[int, list[np.ndarray]]]:
    build, shape = MODELS[request.param]
    model = build()
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    inputs = {b: RNG.standard_normal((b, *shape)).astype(np.float32) for b in BATCHES}
    expected = {b: session.run(None, {name: x}) for b, x in inputs.items()}
    return model, convert(model), inputs, expected


def _eager(module: torch.nn.Module, example: torch.Tensor) -> Runner:
    return module


def _traced(module: torch.nn.Module, example: torch.Tensor) -> Runner:
    traced: Runner = torch.jit.trace(module, (example,))  # type: ignore[no-untyped-call]
    return traced


def _exported(module: torch.nn.Module, example: torch.Tensor) -> Runner:
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
    exported: Runner = program.module()
    return exported


# torch 2.13 deprecates torch.jit.trace; kiln's TorchScript output still uses it.
@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.trace_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("mode", [_eager, _traced, _exported], ids=["eager", "jit-trace", "export"])
def test_model_matches_onnxruntime_at_batch_1_and_4(
        model_case: tuple[onnx.ModelProto, torch.nn.Module, dict[int, np.ndarray], dict[int, list[np.ndarray]]],
        mode: Callable[[torch.nn.Module, torch.Tensor], Runner]) -> None:
    _, module, inputs, expected = model_case
    example = torch.from_numpy(RNG.standard_normal(inputs[4].shape).astype(np.float32)[:2])
    with torch.no_grad():
        runner = mode(module, example)
        for batch in BATCHES:
            got = runner(torch.from_numpy(inputs[batch]))
            assert len(got) == len(expected[batch])
            for g, e in zip(got, expected[batch], strict=True):
                np.testing.assert_allclose(g.numpy(), e, atol=1e-5, rtol=1e-5)


def test_forward_takes_inputs_in_graph_order_and_returns_outputs_in_graph_order() -> None:
    module = convert(build_simple())
    a = torch.arange(32, dtype=torch.int32).reshape(2, 16)
    b = torch.full((2, 16), 3, dtype=torch.int32)
    added, subtracted = module(a, b)
    assert torch.equal(added, a + b) and torch.equal(subtracted, a - b)
    assert module.onnx_inputs == ("INPUT0", "INPUT1") and module.onnx_outputs == ("OUTPUT0", "OUTPUT1")


def test_initializer_listed_as_graph_input_is_a_weight_not_an_input() -> None:
    weight = numpy_helper.from_array(np.full(3, 2.0, np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [weight])
    module = convert(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    (y,) = module(torch.ones(2, 3))
    assert torch.equal(y, torch.full((2, 3), 2.0))
    assert list(module.state_dict()) == ["w"]


def test_weights_are_buffers_that_follow_dtype_and_state_dict() -> None:
    model = build_mlp()
    module = convert(model)
    names = {t.name for t in model.graph.initializer}
    state = module.state_dict()
    assert {k.replace("_", ".") for k in state} == names  # fc0.weight -> fc0_weight
    np.testing.assert_array_equal(state["fc0_weight"].numpy(), numpy_helper.to_array(model.graph.initializer[0]))
    x = torch.from_numpy(RNG.standard_normal((3, 64)).astype(np.float32))
    with torch.no_grad():
        reference = module(x)[0]
        module.double()
        assert all(b.dtype == torch.float64 for b in module.buffers())
        doubled = module(x.double())[0]
    assert doubled.dtype == torch.float64
    np.testing.assert_allclose(doubled.numpy(), reference.numpy(), atol=1e-5)


def test_demo_resnet50_with_narrow_channels_matches_onnxruntime() -> None:
    model = build_resnet50(base_channels=4, image_size=32, num_classes=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    module = convert(model)
    for batch in BATCHES:
        x = RNG.standard_normal((batch, 3, 32, 32)).astype(np.float32)
        (expected,) = session.run(None, {"input": x})
        with torch.no_grad():
            (got,) = module(torch.from_numpy(x))
        np.testing.assert_allclose(got.numpy(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_resnet_on_cuda_in_half_precision() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: PyTorch reports torch.cuda.is_available() == False")
    model = build_resnet50(base_channels=8, image_size=32, num_classes=10)
    x = RNG.standard_normal((4, 3, 32, 32)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, {"input": x})
    module = convert(model).cuda().half()
    with torch.no_grad():
        (got,) = module(torch.from_numpy(x).cuda().half())
    assert got.dtype == torch.float16 and got.device.type == "cuda"
    np.testing.assert_allclose(got.float().cpu().numpy(), expected, atol=3e-2, rtol=3e-2)
