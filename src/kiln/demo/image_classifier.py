"""``image_classifier``: a small image classifier in the shape Triton's image examples expect (``image_client.py
-m image_classifier -s INCEPTION <image>``): one FP32 image input in CHW layout (``format: FORMAT_NCHW`` in its
config), one FP32 vector of class scores, a labels file for classification. Its weights are random (seeded): the
classes it names are placeholders, its answers are not a real classifier's."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.demo.models import batched_tensor, dense_params, make_demo_model, model_rng

NAME = "image_classifier"
CHANNELS, HEIGHT, WIDTH = 3, 224, 224
LABELS = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
FEATURES = 16

CONFIG = f"""name: "{NAME}"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "INPUT" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ {CHANNELS}, {HEIGHT}, {WIDTH} ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ {len(LABELS)} ] label_filename: "labels.txt" }} ]
parameters {{ key: "intra_op_thread_count" value: {{ string_value: "1" }} }}
"""


def build_image_classifier(seed: int = 0) -> onnx.ModelProto:
    """INPUT [3, 224, 224] -> 4x4 average pooling of each channel -> Gemm to 16 features -> ReLU -> Gemm -> Softmax
    over the classes: cheap, yet every pixel region moves the answer."""
    rng = model_rng(seed, NAME)
    pooled = CHANNELS * 4 * 4
    hidden_w, hidden_b = dense_params(rng, pooled, FEATURES)
    out_w, out_b = dense_params(rng, FEATURES, len(LABELS))
    size = [HEIGHT // 4, WIDTH // 4]
    nodes = [
        helper.make_node("AveragePool", ["INPUT"], ["pooled"], kernel_shape=size, strides=size, name="pool"),
        helper.make_node("Flatten", ["pooled"], ["flat"], axis=1, name="flatten"),
        helper.make_node("Gemm", ["flat", "hidden.weight", "hidden.bias"], ["hidden"], transB=1, name="hidden"),
        helper.make_node("Relu", ["hidden"], ["relu"], name="relu"),
        helper.make_node("Gemm", ["relu", "out.weight", "out.bias"], ["logits"], transB=1, name="out"),
        helper.make_node("Softmax", ["logits"], ["OUTPUT"], axis=1, name="softmax"),
    ]
    initializers = [numpy_helper.from_array(np.asarray(array, dtype=np.float32), name) for name, array in (
        ("hidden.weight", hidden_w), ("hidden.bias", hidden_b), ("out.weight", out_w), ("out.bias", out_b))]
    graph = helper.make_graph(nodes, NAME, [batched_tensor("INPUT", TensorProto.FLOAT, CHANNELS, HEIGHT, WIDTH)],
                              [batched_tensor("OUTPUT", TensorProto.FLOAT, len(LABELS))], initializer=initializers)
    return make_demo_model(graph)


def labels_file() -> bytes:
    return "".join(f"{label}\n" for label in LABELS).encode()
