"""The flow of Triton's image classification example (tritonclient's src/python/examples/image_client.py,
``-m image_classifier -s INCEPTION``) with the real tritonclient against `kiln serve`: the checks its parse_model
makes of the metadata and configuration, its preprocessing, and classification answers, over HTTP and gRPC."""

from __future__ import annotations

import struct
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.model_config_pb2 as mc
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from kiln.demo.image_classifier import LABELS, NAME, build_image_classifier
from kiln.testing.serve import KilnProcess

pytestmark = pytest.mark.conformance


def parse_model(metadata: Any, config: Any) -> tuple[int, str, str, int, int, int, int]:
    """What image_client.py requires of a model, as it checks it: one input and one output, an FP32 output that is
    a vector, an input of three dimensions (plus the batch) in NCHW or NHWC format."""
    assert len(metadata["inputs"]) == 1 and len(metadata["outputs"]) == 1 and len(config["input"]) == 1
    output, tensor, input_config = metadata["outputs"][0], metadata["inputs"][0], config["input"][0]
    assert output["datatype"] == "FP32"
    batching = config["max_batch_size"] > 0
    assert sum(1 for dim in output["shape"][1 if batching else 0:] if dim > 1) <= 1, "output must be a vector"
    assert len(tensor["shape"]) == 3 + batching
    layout = input_config["format"]
    layout = mc.ModelInput.Format.Value(layout) if isinstance(layout, str) else layout
    assert layout in (mc.ModelInput.FORMAT_NCHW, mc.ModelInput.FORMAT_NHWC)
    c, h, w = tensor["shape"][1:] if layout == mc.ModelInput.FORMAT_NCHW else np.roll(tensor["shape"][1:], 1)
    return config["max_batch_size"], tensor["name"], output["name"], int(c), int(h), int(w), layout


def inception(image: np.ndarray, layout: int) -> np.ndarray:
    """The example's INCEPTION scaling of an RGB image (HWC, uint8), in the model's layout."""
    scaled = image.astype(np.float32) / 127.5 - 1
    return np.transpose(scaled, (2, 0, 1)) if layout == mc.ModelInput.FORMAT_NCHW else scaled


def _metadata_and_config(protocol: str, server: KilnProcess) -> tuple[Any, Any, Any]:
    if protocol == "http":
        client: Any = httpclient.InferenceServerClient(server.http_url)
        return client, client.get_model_metadata(NAME), client.get_model_config(NAME)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    metadata = client.get_model_metadata(NAME, as_json=True)
    for tensor in (*metadata["inputs"], *metadata["outputs"]):
        tensor["shape"] = [int(d) for d in tensor["shape"]]
    config = client.get_model_config(NAME, as_json=True)["config"]
    config["max_batch_size"] = int(config["max_batch_size"])
    return client, metadata, config


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_image_client_classifies_an_image(kiln_server: KilnProcess, protocol: str) -> None:
    client, metadata, config = _metadata_and_config(protocol, kiln_server)
    max_batch, input_name, output_name, c, h, w, layout = parse_model(metadata, config)
    assert (max_batch, c, h, w) == (8, 3, 224, 224)
    # One image per request, the example's default (the conformance server takes bodies up to 1 MiB).
    images = np.random.default_rng(7).integers(0, 256, (1, h, w, c), dtype=np.uint8)
    batch = np.stack([inception(image, layout) for image in images])
    module: Any = httpclient if protocol == "http" else grpcclient
    tensor = module.InferInput(input_name, list(batch.shape), "FP32")
    tensor.set_data_from_numpy(batch)
    result = client.infer(NAME, [tensor], outputs=[module.InferRequestedOutput(output_name, class_count=3)])
    answers = result.as_numpy(output_name)
    assert answers.shape == (1, 3)
    reference = ort.InferenceSession(build_image_classifier().SerializeToString(),
                                     providers=["CPUExecutionProvider"]).run(None, {"INPUT": batch})[0]
    for row, scores in zip(answers, reference, strict=True):
        parts = [entry.decode().split(":") for entry in row]  # "score:index:label", best first
        top3 = np.argsort(-scores, kind="stable")[:3]
        assert [int(index) for _, index, _ in parts] == top3.tolist()
        assert [label for _, _, label in parts] == [LABELS[i] for i in top3]
        assert np.allclose([float(score) for score, _, _ in parts], scores[top3], atol=1e-5)
    client.close()


def _classes(raw: bytes) -> list[list[str]]:
    """A BYTES tensor as grpc_image_client.py reads it: 4-byte little-endian lengths, each entry 'score:index:label'."""
    entries, offset = [], 0
    while offset < len(raw):
        (size,) = struct.unpack_from("<I", raw, offset)
        entries.append(raw[offset + 4:offset + 4 + size].decode().split(":"))
        offset += 4 + size
    return entries


@pytest.mark.parametrize("streaming", [False, True])
def test_grpc_image_client_flow_over_the_raw_stubs(kiln_server: KilnProcess, streaming: bool) -> None:
    """grpc_image_client.py: metadata and config from the generated stubs, the image as raw_input_contents, the
    classification answer as one raw BYTES content reshaped by the output's shape; with --streaming, the same
    request over ModelStreamInfer."""
    channel = grpc.insecure_channel(kiln_server.grpc_url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    metadata = stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=NAME, version=""))
    config = stub.ModelConfig(service_pb2.ModelConfigRequest(name=NAME, version="")).config
    assert len(metadata.inputs) == len(metadata.outputs) == len(config.input) == 1
    assert metadata.outputs[0].datatype == "FP32" and config.input[0].format == mc.ModelInput.FORMAT_NCHW
    c, h, w = (int(d) for d in metadata.inputs[0].shape[1:])
    image = np.random.default_rng(11).integers(0, 256, (h, w, c), dtype=np.uint8)
    batch = inception(image, config.input[0].format)[np.newaxis]
    request = service_pb2.ModelInferRequest(model_name=NAME, model_version="")
    output = request.outputs.add(name=metadata.outputs[0].name)
    output.parameters["classification"].int64_param = 2
    request.inputs.add(name=metadata.inputs[0].name, datatype=metadata.inputs[0].datatype, shape=[1, c, h, w])
    request.raw_input_contents.append(batch.astype(np.float32).tobytes())
    if streaming:
        (reply,) = list(stub.ModelStreamInfer(iter([request])))
        assert reply.error_message == ""
        response = reply.infer_response
    else:
        response = stub.ModelInfer(request)
    assert len(response.outputs) == 1 and len(response.raw_output_contents) == 1
    assert list(response.outputs[0].shape) == [1, 2]
    rows = np.reshape(np.array(_classes(response.raw_output_contents[0]), dtype=object), (1, 2, 3))
    scores = ort.InferenceSession(build_image_classifier().SerializeToString(),
                                  providers=["CPUExecutionProvider"]).run(None, {"INPUT": batch})[0][0]
    top2 = np.argsort(-scores, kind="stable")[:2]
    assert [int(index) for _, index, _ in rows[0]] == top2.tolist()
    assert [label for _, _, label in rows[0]] == [LABELS[i] for i in top2]
    channel.close()
