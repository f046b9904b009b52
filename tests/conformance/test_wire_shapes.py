"""The exact inference response documents and messages, read off the wire, for every kind of output.

What Triton sends (its HTTP frontend, http_server.cc FinalizeResponse; its gRPC frontend, infer_handler's
response allocator and InferResponseCompleteCommon):

- HTTP, an output in the JSON body: ``name``, ``datatype``, ``shape``, ``data``; no ``parameters``.
- HTTP, a binary output: ``name``, ``datatype``, ``shape``, ``parameters: {"binary_data_size": n}`` and nothing else
  in ``parameters``; its bytes follow the JSON header, in output order.
- HTTP, an output written to system or CUDA shared memory: ``name``, ``datatype``, ``shape`` only. Triton's C++
  client (perf_analyzer) takes any ``parameters`` of an output as the binary-data size and fails on one without
  ``binary_data_size``.
- HTTP, classification: ``datatype`` BYTES, ``shape`` [batch, k], strings "value:index[:label]" with the value as
  C++ ``std::to_string`` writes it, as JSON data or as binary like any BYTES output.
- gRPC: every output in request order with one ``raw_output_contents`` entry each, an empty one for an output in
  shared memory, and no per-output ``parameters``. Triton's C++ client reads ``raw_output_contents[i]`` for the
  i-th output without checking the count.
"""

from __future__ import annotations

import json
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from kiln.demo import build_demo_repository
from kiln.testing.serve import KilnProcess, kiln_serve

pytestmark = pytest.mark.conformance

IN0, IN1 = np.arange(16, dtype=np.int32).reshape(1, 16), np.full((1, 16), 3, dtype=np.int32)
SUM, DIFF = IN0 + IN1, IN0 - IN1
TENSOR_BYTES = 64
SIMPLE_INPUTS = [
    {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": IN0.reshape(-1).tolist()},
    {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": IN1.reshape(-1).tolist()},
]
LABELS = [f"class_{i}" for i in range(10)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("repo")
    build_demo_repository(repo)
    _add_labeled_mlp(repo)
    with kiln_serve([repo], "--allow-client-shm", "true", "--exit-timeout-secs", "5") as process:
        yield process


def _add_labeled_mlp(repo: Path) -> None:
    labeled = repo / "mlp_labeled"
    (labeled / "1").mkdir(parents=True)
    (labeled / "1" / "model.onnx").write_bytes((repo / "mlp" / "1" / "model.onnx").read_bytes())
    config = (repo / "mlp" / "config.pbtxt").read_text().replace('name: "mlp"', 'name: "mlp_labeled"')
    (labeled / "config.pbtxt").write_text(config.replace('name: "OUTPUT0"', 'name: "OUTPUT0" label_filename: "l.txt"'))
    (labeled / "l.txt").write_text("".join(f"{label}\n" for label in LABELS))


@pytest.fixture
def regions(server: KilnProcess) -> Iterator[str]:
    """A registered system shared-memory region ``tag`` holding INPUT0 then INPUT1, and ``out_<tag>`` with room
    for two outputs, registered at an offset as perf_analyzer may do (the region starts 8 bytes in)."""
    tag = uuid.uuid4().hex[:8]
    inputs = shm.create_shared_memory_region(f"in_{tag}", f"/kiln_wire_in_{tag}", 2 * TENSOR_BYTES)
    outputs = shm.create_shared_memory_region(f"out_{tag}", f"/kiln_wire_out_{tag}", 8 + 2 * TENSOR_BYTES)
    shm.set_shared_memory_region(inputs, [IN0, IN1])
    client = httpclient.InferenceServerClient(server.http_url)
    client.register_system_shared_memory(f"in_{tag}", f"/kiln_wire_in_{tag}", 2 * TENSOR_BYTES)
    client.register_system_shared_memory(f"out_{tag}", f"/kiln_wire_out_{tag}", 2 * TENSOR_BYTES, offset=8)
    yield tag
    client.unregister_system_shared_memory(f"in_{tag}")
    client.unregister_system_shared_memory(f"out_{tag}")
    shm.destroy_shared_memory_region(inputs)
    shm.destroy_shared_memory_region(outputs)
    client.close()


def _read_output(tag: str, index: int) -> np.ndarray:
    with open(f"/dev/shm/kiln_wire_out_{tag}", "rb") as region:
        region.seek(8 + index * TENSOR_BYTES)
        return np.frombuffer(region.read(TENSOR_BYTES), np.int32).reshape(1, 16)


def _post(server: KilnProcess, model: str, doc: dict[str, Any]) -> tuple[dict[str, Any], bytes, httpx.Response]:
    """The response's JSON document and the binary data after it."""
    response = httpx.post(f"http://{server.http_url}/v2/models/{model}/infer", json=doc)
    assert response.status_code == 200, response.text
    length = response.headers.get("inference-header-content-length")
    split = len(response.content) if length is None else int(length)
    return json.loads(response.content[:split]), response.content[split:], response


def _shm(tag: str, index: int) -> dict[str, Any]:
    return {"shared_memory_region": f"out_{tag}", "shared_memory_byte_size": TENSOR_BYTES,
            "shared_memory_offset": index * TENSOR_BYTES}


def _int32_output(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "datatype": "INT32", "shape": [1, 16], **extra}


# -- HTTP ----------------------------------------------------------------------------------------------------


def test_http_outputs_in_the_json_body(server: KilnProcess) -> None:
    doc, rest, response = _post(server, "simple", {"id": "r1", "inputs": SIMPLE_INPUTS})
    assert doc == {"id": "r1", "model_name": "simple", "model_version": "1", "outputs": [
        _int32_output("OUTPUT0", data=SUM.reshape(-1).tolist()),
        _int32_output("OUTPUT1", data=DIFF.reshape(-1).tolist())]}
    assert rest == b"" and response.headers["content-type"] == "application/json"


def test_http_binary_and_json_outputs_side_by_side(server: KilnProcess) -> None:
    request = {"inputs": SIMPLE_INPUTS, "parameters": {"binary_data_output": True},
               "outputs": [{"name": "OUTPUT0"}, {"name": "OUTPUT1", "parameters": {"binary_data": False}}]}
    doc, rest, response = _post(server, "simple", request)
    assert doc == {"model_name": "simple", "model_version": "1", "outputs": [
        _int32_output("OUTPUT0", parameters={"binary_data_size": TENSOR_BYTES}),
        _int32_output("OUTPUT1", data=DIFF.reshape(-1).tolist())]}
    assert rest == SUM.astype("<i4").tobytes()
    assert response.headers["content-type"] == "application/octet-stream"


@pytest.mark.parametrize("binary_data", [False, True])
def test_http_outputs_in_system_shared_memory_carry_no_parameters(server: KilnProcess, regions: str,
                                                                  binary_data: bool) -> None:
    tag = regions
    inputs = [{"name": name, "shape": [1, 16], "datatype": "INT32",
               "parameters": {"shared_memory_region": f"in_{tag}", "shared_memory_byte_size": TENSOR_BYTES,
                              "shared_memory_offset": i * TENSOR_BYTES}} for i, name in enumerate(["INPUT0", "INPUT1"])]
    outputs = [{"name": name, "parameters": {**_shm(tag, i), "binary_data": binary_data}}
               for i, name in enumerate(["OUTPUT0", "OUTPUT1"])]
    doc, rest, response = _post(server, "simple", {"inputs": inputs, "outputs": outputs})
    assert doc == {"model_name": "simple", "model_version": "1",
                   "outputs": [_int32_output("OUTPUT0"), _int32_output("OUTPUT1")]}
    assert rest == b"" and "inference-header-content-length" not in response.headers
    np.testing.assert_array_equal(_read_output(tag, 0), SUM)
    np.testing.assert_array_equal(_read_output(tag, 1), DIFF)


def test_http_one_output_in_shared_memory_and_one_binary(server: KilnProcess, regions: str) -> None:
    tag = regions
    outputs = [{"name": "OUTPUT0", "parameters": _shm(tag, 0)},
               {"name": "OUTPUT1", "parameters": {"binary_data": True}}]
    doc, rest, _ = _post(server, "simple", {"inputs": SIMPLE_INPUTS, "outputs": outputs})
    assert doc["outputs"] == [_int32_output("OUTPUT0"),
                              _int32_output("OUTPUT1", parameters={"binary_data_size": TENSOR_BYTES})]
    assert rest == DIFF.astype("<i4").tobytes()
    np.testing.assert_array_equal(_read_output(tag, 0), SUM)


def _top3(server: KilnProcess, model: str, x: np.ndarray, labels: list[str] | None = None) -> list[str]:
    """The classification strings Triton builds from the raw logits: "value:index[:label]", highest first."""
    doc, _, _ = _post(server, model, {"inputs": [{"name": "INPUT0", "shape": [1, 64], "datatype": "FP32",
                                                  "data": x.reshape(-1).tolist()}]})
    logits = np.array(doc["outputs"][0]["data"], np.float32)
    order = np.argsort(-logits, kind="stable")[:3]
    return [f"{float(logits[i]):f}:{i}" + (f":{labels[i]}" if labels else "") for i in order]


@pytest.mark.parametrize(("model", "labels"), [("mlp", None), ("mlp_labeled", LABELS)])
def test_http_classification_as_json(server: KilnProcess, model: str, labels: list[str] | None) -> None:
    x = np.random.default_rng(5).standard_normal((1, 64)).astype(np.float32)
    request = {"inputs": [{"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": x.reshape(-1).tolist()}],
               "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 3}}]}
    doc, rest, _ = _post(server, model, request)
    assert doc == {"model_name": model, "model_version": "1", "outputs": [
        {"name": "OUTPUT0", "datatype": "BYTES", "shape": [1, 3], "data": _top3(server, model, x, labels)}]}
    assert rest == b""


def _length_prefixed(texts: list[str]) -> bytes:
    return b"".join(struct.pack("<I", len(t.encode())) + t.encode() for t in texts)


def test_http_classification_as_binary(server: KilnProcess) -> None:
    x = np.random.default_rng(6).standard_normal((1, 64)).astype(np.float32)
    request = {"inputs": [{"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": x.reshape(-1).tolist()}],
               "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 3, "binary_data": True}}]}
    doc, rest, _ = _post(server, "mlp", request)
    expected = _length_prefixed(_top3(server, "mlp", x))
    assert doc["outputs"] == [{"name": "OUTPUT0", "datatype": "BYTES", "shape": [1, 3],
                               "parameters": {"binary_data_size": len(expected)}}]
    assert rest == expected


@pytest.mark.parametrize("binary_data", [False, True])
def test_http_bytes_outputs(server: KilnProcess, binary_data: bool) -> None:
    texts = ["a", "", "he\x00llo", "ünï"]
    request = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "BYTES", "data": texts}],
               "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": binary_data}}]}
    doc, rest, _ = _post(server, "simple_identity", request)
    output: dict[str, Any] = {"name": "OUTPUT0", "datatype": "BYTES", "shape": [1, 4]}
    if binary_data:
        output["parameters"] = {"binary_data_size": len(_length_prefixed(texts))}
    else:
        output["data"] = texts
    assert doc == {"model_name": "simple_identity", "model_version": "1", "outputs": [output]}
    assert rest == (_length_prefixed(texts) if binary_data else b"")


# -- gRPC ----------------------------------------------------------------------------------------------------


def _grpc_request(module: Any, tag: str, shm_outputs: tuple[str, ...]) -> tuple[list[Any], list[Any]]:
    """perf_analyzer's request: inputs from the region, outputs in shared memory with no other parameter."""
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory(f"in_{tag}", TENSOR_BYTES)
    inputs[1].set_shared_memory(f"in_{tag}", TENSOR_BYTES, offset=TENSOR_BYTES)
    outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
    for index, output in enumerate(outputs):
        if output.name() in shm_outputs:
            output.set_shared_memory(f"out_{tag}", TENSOR_BYTES, offset=index * TENSOR_BYTES)
    return inputs, outputs


def _check_grpc_response(message: Any, tag: str, shm_outputs: tuple[str, ...]) -> None:
    assert [(o.name, o.datatype, list(o.shape)) for o in message.outputs] == [
        ("OUTPUT0", "INT32", [1, 16]), ("OUTPUT1", "INT32", [1, 16])]
    assert all(len(o.parameters) == 0 for o in message.outputs)
    expected = {"OUTPUT0": SUM, "OUTPUT1": DIFF}
    assert list(message.raw_output_contents) == [
        b"" if name in shm_outputs else expected[name].astype("<i4").tobytes() for name in ("OUTPUT0", "OUTPUT1")]
    for index, name in enumerate(("OUTPUT0", "OUTPUT1")):
        if name in shm_outputs:
            np.testing.assert_array_equal(_read_output(tag, index), expected[name])


@pytest.mark.parametrize("shm_outputs", [("OUTPUT0", "OUTPUT1"), ("OUTPUT0",)])
def test_grpc_outputs_in_shared_memory_have_empty_raw_contents(server: KilnProcess, regions: str,
                                                                shm_outputs: tuple[str, ...]) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs, outputs = _grpc_request(grpcclient, regions, shm_outputs)
    result = client.infer("simple", inputs, outputs=outputs)
    _check_grpc_response(result.get_response(), regions, shm_outputs)
    if shm_outputs == ("OUTPUT0",):
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), DIFF)
    client.close()


def test_grpc_stream_outputs_in_shared_memory(server: KilnProcess, regions: str) -> None:
    """perf_analyzer --streaming: ModelStreamInfer with every output in shared memory."""
    answers: list[Any] = []
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.append(error or result))
    inputs, outputs = _grpc_request(grpcclient, regions, ("OUTPUT0", "OUTPUT1"))
    for _ in range(3):
        client.async_stream_infer("simple", inputs, outputs=outputs)
    client.stop_stream()  # waits for the answers
    assert len(answers) == 3
    for answer in answers:
        _check_grpc_response(answer.get_response(), regions, ("OUTPUT0", "OUTPUT1"))
    client.close()


async def test_grpc_aio_outputs_in_shared_memory(server: KilnProcess, regions: str) -> None:
    async with grpcaio.InferenceServerClient(server.grpc_url) as client:
        inputs, outputs = _grpc_request(grpcaio, regions, ("OUTPUT0", "OUTPUT1"))
        result = await client.infer("simple", inputs, outputs=outputs)
        _check_grpc_response(result.get_response(), regions, ("OUTPUT0", "OUTPUT1"))
