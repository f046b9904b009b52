"""ResNet-50 v1.5 as an ONNX graph with random weights.

The layout matches torchvision's ``resnet50``: the stride of a downsampling bottleneck sits on its 3x3 conv
(v1.5), and each stage's first block has a 1x1 projection shortcut. BatchNorm is folded away, so every Conv
carries a bias, as in an inference export; ``base_channels`` shrinks the width for fast tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.demo.models import batched_tensor, make_demo_model, model_rng

# (bottleneck blocks, bottleneck width as a multiple of base_channels) per stage: ResNet-50's [3, 4, 6, 3].
STAGES: tuple[tuple[int, int], ...] = ((3, 1), (4, 2), (6, 4), (3, 8))
EXPANSION = 4
# Scale of each residual branch's last conv, standing in for a small folded BatchNorm gamma: without it,
# He-initialised branches double the activation variance at each of the 16 residual adds.
RESIDUAL_GAIN = 0.2


class _GraphBuilder:
    """Accumulates nodes and initializers; each method returns the name of the tensor it produced."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def _param(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def conv(self, name: str, x: str, in_ch: int, out_ch: int, kernel: int, stride: int = 1, gain: float = 1.0) -> str:
        # He-normal over fan_out, as torchvision initialises convs; the bias is the folded BatchNorm beta (zero).
        std = gain * np.sqrt(2.0 / (out_ch * kernel * kernel))
        weight = self.rng.standard_normal((out_ch, in_ch, kernel, kernel), dtype=np.float32) * np.float32(std)
        w = self._param(f"{name}.weight", weight)
        b = self._param(f"{name}.bias", np.zeros(out_ch, dtype=np.float32))
        pad = kernel // 2
        self.nodes.append(
            helper.make_node(
                "Conv",
                [x, w, b],
                [name],
                name=name,
                kernel_shape=[kernel, kernel],
                strides=[stride, stride],
                pads=[pad] * 4,
            )
        )
        return name

    def op(self, op_type: str, name: str, inputs: list[str], **attrs: Any) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [name], name=name, **attrs))
        return name

    def bottleneck(self, name: str, x: str, in_ch: int, width: int, stride: int) -> str:
        out_ch = width * EXPANSION
        y = self.op("Relu", f"{name}.relu1", [self.conv(f"{name}.conv1", x, in_ch, width, 1)])
        # v1.5: the 3x3 conv downsamples, not the first 1x1 (v1), so no activations are skipped over.
        y = self.op("Relu", f"{name}.relu2", [self.conv(f"{name}.conv2", y, width, width, 3, stride)])
        y = self.conv(f"{name}.conv3", y, width, out_ch, 1, gain=RESIDUAL_GAIN)
        shortcut = x
        if stride != 1 or in_ch != out_ch:
            shortcut = self.conv(f"{name}.downsample", x, in_ch, out_ch, 1, stride)
        return self.op("Relu", f"{name}.relu3", [self.op("Add", f"{name}.add", [y, shortcut])])

    def fc(self, name: str, x: str, in_features: int, out_features: int, output: str) -> str:
        # torch.nn.Linear's default init, in its [out, in] layout (hence transB).
        bound = 1.0 / np.sqrt(in_features)
        weight = self.rng.uniform(-bound, bound, (out_features, in_features)).astype(np.float32)
        bias = self.rng.uniform(-bound, bound, out_features).astype(np.float32)
        inputs = [x, self._param(f"{name}.weight", weight), self._param(f"{name}.bias", bias)]
        return self.op("Gemm", output, inputs, transB=1)


def build_resnet50(
    seed: int = 0, *, base_channels: int = 64, image_size: int = 224, num_classes: int = 1000
) -> onnx.ModelProto:
    """ResNet-50 v1.5: ``input`` FP32 [batch, 3, image_size, image_size] -> ``output`` FP32 [batch, num_classes]."""
    g = _GraphBuilder(model_rng(seed, "resnet50"))
    x = g.op("Relu", "relu", [g.conv("conv1", "input", 3, base_channels, 7, 2)])
    x = g.op("MaxPool", "maxpool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    channels = base_channels
    for stage, (blocks, multiple) in enumerate(STAGES, start=1):
        width = base_channels * multiple
        for block in range(blocks):
            # The first stage follows the max pool, so it keeps the resolution.
            stride = 2 if block == 0 and stage > 1 else 1
            x = g.bottleneck(f"layer{stage}.{block}", x, channels, width, stride)
            channels = width * EXPANSION
    x = g.op("Flatten", "flatten", [g.op("GlobalAveragePool", "avgpool", [x])], axis=1)
    g.fc("fc", x, channels, num_classes, output="output")
    graph = helper.make_graph(
        g.nodes,
        "resnet50",
        [batched_tensor("input", TensorProto.FLOAT, 3, image_size, image_size)],
        [batched_tensor("output", TensorProto.FLOAT, num_classes)],
        initializer=g.initializers,
    )
    return make_demo_model(graph)
