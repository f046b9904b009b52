"""POST /v2/models/{m}/infer over the real app and Server, in process (httpx ASGITransport, no sockets)."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as triton_http
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from kiln.demo import build_demo_repository
from kiln.frontends.http import build_app
from kiln.server.server import Server, ServerOptions

LIMIT = 4096

_IDENTITY = """name: "{name}"
backend: "identity"
max_batch_size: {batch}
input [ {{ name: "INPUT0" data_type: {dtype} dims: {dims} }} ]
output [ {{ name: "OUTPUT0" data_type: {dtype} dims: {dims} {extra}}} ]
"""

_MIXED = """name: "mixed"
backend: "identity"
input [
  { name: "B" data_type: TYPE_BOOL dims: [ 2 ] },
  { name: "H" data_type: TYPE_BF16 dims: [ 2 ] },
  { name: "U" data_type: TYPE_UINT8 dims: [ 2 ] }
]
output [
  { name: "B_OUT" data_type: TYPE_BOOL dims: [ 2 ] },
  { name: "H_OUT" data_type: TYPE_BF16 dims: [ 2 ] },
  { name: "U_OUT" data_type: TYPE_UINT8 dims: [ 2 ] }
]
"""


def _model(root: Path, name: str, config: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(config)


def _identity(root: Path, name: str, dtype: str, dims: str = "[ -1 ]", batch: int = 8, extra: str = "") -> None:
    _model(root, name, _IDENTITY.format(name=name, dtype=dtype, dims=dims, batch=batch, extra=extra))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("repo")
    build_demo_repository(root)
    _identity(root, "strings", "TYPE_STRING")
    _identity(root, "halves", "TYPE_FP16")
    _identity(root, "scores", "TYPE_FP32", "[ 4 ]", batch=4)
    _identity(root, "labeled", "TYPE_FP32", "[ 4 ]", batch=4, extra='label_filename: "labels.txt" ')
    (root / "labeled" / "labels.txt").write_text("cat\ndog\nbird\nfish\n")
    _identity(root, "blob", "TYPE_STRING", "[ 1 ]", batch=0)
    _model(root, "mixed", _MIXED)
    instance = Server(ServerOptions(repositories=[root]))
    instance.start()
    yield instance
    instance.close()


@pytest.fixture
async def client(server: Server) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(server, max_input_size=LIMIT)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kiln") as http:
        yield http


def _simple(**extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16},
    ]}
    doc.update(extra)
    return doc


def _binary(doc: dict[str, Any], *blobs: bytes) -> tuple[bytes, dict[str, str]]:
    header = json.dumps(doc).encode()
    return header + b"".join(blobs), {"Inference-Header-Content-Length": str(len(header))}


def _split(response: httpx.Response) -> tuple[dict[str, Any], bytes]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    size = int(response.headers["inference-header-content-length"])
    return json.loads(response.content[:size]), response.content[size:]


def _error(response: httpx.Response, status: int = 400) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert list(body) == ["error"]
    message: str = body["error"]
    return message


SUM = [i + 1 for i in range(16)]
DIFF = [i - 1 for i in range(16)]


# -- JSON ----------------------------------------------------------------------------------------------------


async def test_simple_json_infer_returns_sum_and_difference(client: httpx.AsyncClient) -> None:
    response = await client.post("/v2/models/simple/infer", json=_simple(id="req-7"))
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert "inference-header-content-length" not in response.headers
    assert response.json() == {"model_name": "simple", "model_version": "1", "id": "req-7", "outputs": [
        {"name": "OUTPUT0", "datatype": "INT32", "shape": [1, 16], "data": SUM},
        {"name": "OUTPUT1", "datatype": "INT32", "shape": [1, 16], "data": DIFF},
    ]}


async def test_versioned_path_nested_data_and_query_string(client: httpx.AsyncClient) -> None:
    doc = _simple()
    doc["inputs"][0]["data"] = [list(range(16))]
    response = await client.post("/v2/models/simple/versions/1/infer?trace=1", json=doc)
    assert response.status_code == 200 and response.json()["outputs"][0]["data"] == SUM


async def test_output_subset_returns_only_the_requested_output(client: httpx.AsyncClient) -> None:
    response = await client.post("/v2/models/simple/infer", json=_simple(outputs=[{"name": "OUTPUT1"}]))
    assert [o["name"] for o in response.json()["outputs"]] == ["OUTPUT1"]
    assert response.json()["outputs"][0]["data"] == DIFF


async def test_mlp_json_matches_binary(client: httpx.AsyncClient) -> None:
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)
    as_json = await client.post("/v2/models/mlp/infer", json={"inputs": [
        {"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": x.tolist()}]})
    body, headers = _binary({"inputs": [{"name": "INPUT0", "shape": [1, 64], "datatype": "FP32",
                                         "parameters": {"binary_data_size": 256}}],
                             "parameters": {"binary_data_output": True}}, x.tobytes())
    doc, blob = _split(await client.post("/v2/models/mlp/infer", content=body, headers=headers))
    assert doc["outputs"][0]["shape"] == [1, 10]
    assert np.frombuffer(blob, "<f4").tolist() == as_json.json()["outputs"][0]["data"]


async def test_bool_bf16_uint8_json_round_trip(client: httpx.AsyncClient) -> None:
    doc = {"inputs": [{"name": "B", "shape": [2], "datatype": "BOOL", "data": [True, False]},
                      {"name": "H", "shape": [2], "datatype": "BF16", "data": [1.5, -2]},
                      {"name": "U", "shape": [2], "datatype": "UINT8", "data": [0, 255]}]}
    outputs = (await client.post("/v2/models/mixed/infer", json=doc)).json()["outputs"]
    assert [(o["name"], o["datatype"], o["data"]) for o in outputs] == [
        ("B_OUT", "BOOL", [True, False]), ("H_OUT", "BF16", [1.5, -2.0]), ("U_OUT", "UINT8", [0, 255])]


# -- binary extension ----------------------------------------------------------------------------------------


async def test_binary_inputs_with_per_output_binary_flags(client: httpx.AsyncClient) -> None:
    a, b = np.arange(16, dtype="<i4"), np.ones(16, dtype="<i4")
    body, headers = _binary({"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 64}},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 64}},
    ], "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}, {"name": "OUTPUT1"}]},
        a.tobytes(), b.tobytes())
    doc, blob = _split(await client.post("/v2/models/simple/infer", content=body, headers=headers))
    first, second = doc["outputs"]
    assert first == {"name": "OUTPUT0", "datatype": "INT32", "shape": [1, 16], "parameters": {"binary_data_size": 64}}
    assert second["data"] == DIFF
    assert np.frombuffer(blob, "<i4").tolist() == SUM


async def test_binary_data_output_with_per_output_override(client: httpx.AsyncClient) -> None:
    doc = _simple(parameters={"binary_data_output": True},
                  outputs=[{"name": "OUTPUT0"}, {"name": "OUTPUT1", "parameters": {"binary_data": False}}])
    header, blob = _split(await client.post("/v2/models/simple/infer", json=doc))
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 64} and "data" not in header["outputs"][0]
    assert header["outputs"][1]["data"] == DIFF
    assert np.frombuffer(blob, "<i4").tolist() == SUM


async def test_tritonclient_request_body_and_result_round_trip(client: httpx.AsyncClient) -> None:
    a, b = np.arange(32, dtype=np.int32).reshape(2, 16), np.full((2, 16), 3, dtype=np.int32)
    inputs = [triton_http.InferInput("INPUT0", [2, 16], "INT32"), triton_http.InferInput("INPUT1", [2, 16], "INT32")]
    inputs[0].set_data_from_numpy(a, binary_data=True)
    inputs[1].set_data_from_numpy(b, binary_data=False)
    outputs = [triton_http.InferRequestedOutput("OUTPUT0", binary_data=True),
               triton_http.InferRequestedOutput("OUTPUT1", binary_data=False)]
    body, json_size = triton_http.InferenceServerClient.generate_request_body(inputs, outputs, request_id="42")
    headers = {} if json_size is None else {"Inference-Header-Content-Length": str(json_size)}
    response = await client.post("/v2/models/simple/infer", content=body, headers=headers)
    assert response.status_code == 200, response.text
    result = triton_http.InferResult.from_response_body(
        response.content, header_length=int(response.headers["inference-header-content-length"]))
    assert result.get_response()["id"] == "42"
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


async def test_bytes_json_round_trip(client: httpx.AsyncClient) -> None:
    doc = {"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "BYTES", "data": ["héllo", "", "x y"]}]}
    (output,) = (await client.post("/v2/models/strings/infer", json=doc)).json()["outputs"]
    assert output == {"name": "OUTPUT0", "datatype": "BYTES", "shape": [1, 3], "data": ["héllo", "", "x y"]}


async def test_bytes_binary_framing_matches_tritonclient(client: httpx.AsyncClient) -> None:
    values = np.array([[b"\x00\xff", b"", "über".encode()]], dtype=np.object_)
    blob = serialize_byte_tensor(values).item()
    body, headers = _binary({"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "BYTES",
                                         "parameters": {"binary_data_size": len(blob)}}],
                             "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}, blob)
    doc, out = _split(await client.post("/v2/models/strings/infer", content=body, headers=headers))
    assert doc["outputs"][0]["parameters"] == {"binary_data_size": len(blob)}
    assert out == blob
    assert deserialize_bytes_tensor(out).tolist() == values.reshape(-1).tolist()


async def test_fp16_binary_round_trip_and_json_numbers(client: httpx.AsyncClient) -> None:
    x = np.array([[0.5, -1.25, 65504.0]], dtype="<f2")
    for binary in (True, False):
        body, headers = _binary({"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP16",
                                             "parameters": {"binary_data_size": 6}}],
                                 "parameters": {"binary_data_output": binary}}, x.tobytes())
        response = await client.post("/v2/models/halves/infer", content=body, headers=headers)
        if binary:
            doc, blob = _split(response)
            assert doc["outputs"][0]["datatype"] == "FP16"
            np.testing.assert_array_equal(np.frombuffer(blob, "<f2").reshape(1, 3), x)
        else:
            assert response.json()["outputs"][0]["data"] == [0.5, -1.25, 65504.0]


# -- classification ------------------------------------------------------------------------------------------


async def test_classification_with_labels(client: httpx.AsyncClient) -> None:
    doc = {"inputs": [{"name": "INPUT0", "shape": [2, 4], "datatype": "FP32",
                       "data": [[0.1, 0.9, 0.3, 0.2], [5, 1, 2, 7]]}],
           "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 2}}]}
    (output,) = (await client.post("/v2/models/labeled/infer", json=doc)).json()["outputs"]
    assert output["datatype"] == "BYTES" and output["shape"] == [2, 2]
    assert output["data"] == ["0.900000:1:dog", "0.300000:2:bird", "7.000000:3:fish", "5.000000:0:cat"]


async def test_classification_without_labels_as_binary(client: httpx.AsyncClient) -> None:
    doc = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [0.5, 2.5, 1.5, 0]}],
           "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 3, "binary_data": True}}]}
    header, blob = _split(await client.post("/v2/models/scores/infer", json=doc))
    assert header["outputs"][0]["datatype"] == "BYTES" and header["outputs"][0]["shape"] == [1, 3]
    assert deserialize_bytes_tensor(blob).tolist() == [b"2.500000:1", b"1.500000:2", b"0.500000:0"]


# -- raw binary body -----------------------------------------------------------------------------------------


async def test_raw_body_for_a_single_input_model(client: httpx.AsyncClient) -> None:
    x = np.linspace(0, 1, 64, dtype="<f4")
    raw = await client.post("/v2/models/mlp/infer", content=x.tobytes(),
                            headers={"Inference-Header-Content-Length": "0"})
    doc, blob = _split(raw)
    assert doc["outputs"][0]["shape"] == [1, 10]
    as_json = await client.post("/v2/models/mlp/infer", json={"inputs": [
        {"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": x.tolist()}]})
    assert np.frombuffer(blob, "<f4").tolist() == as_json.json()["outputs"][0]["data"]


async def test_raw_body_bytes_model_takes_the_body_as_one_element(client: httpx.AsyncClient) -> None:
    raw = await client.post("/v2/models/blob/infer", content=b"\x00any\xffbytes",
                            headers={"Inference-Header-Content-Length": "0"})
    doc, blob = _split(raw)
    assert doc["outputs"][0]["shape"] == [1]
    assert deserialize_bytes_tensor(blob).tolist() == [b"\x00any\xffbytes"]


async def test_raw_body_errors(client: httpx.AsyncClient) -> None:
    headers = {"Inference-Header-Content-Length": "0"}
    multi = await client.post("/v2/models/simple/infer", content=b"\x00" * 64, headers=headers)
    assert "Inference-Header-Content-Length: 0 needs a model with exactly one input; this one has 2" in _error(multi)
    short = await client.post("/v2/models/mlp/infer", content=b"\x00" * 10, headers=headers)
    assert "10 bytes do not fill shape [1, 64] of FP32" in _error(short)


# -- body handling -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("encoding", "compress"), [("gzip", gzip.compress), ("deflate", zlib.compress)])
async def test_compressed_request_bodies(client: httpx.AsyncClient, encoding: str, compress: Any) -> None:
    body = compress(json.dumps(_simple()).encode())
    response = await client.post("/v2/models/simple/infer", content=body, headers={"Content-Encoding": encoding})
    assert response.status_code == 200 and response.json()["outputs"][0]["data"] == SUM


async def test_compressed_body_errors(client: httpx.AsyncClient) -> None:
    bomb = gzip.compress(b" " * (LIMIT * 10))
    response = await client.post("/v2/models/simple/infer", content=bomb, headers={"Content-Encoding": "gzip"})
    assert _error(response) == (f"decompressed request body of at least {LIMIT + 1} bytes exceeds the limit of "
                                f"{LIMIT} bytes (--http-max-input-size)")
    corrupt = await client.post("/v2/models/simple/infer", content=b"nope", headers={"Content-Encoding": "gzip"})
    assert "not valid gzip data" in _error(corrupt)
    brotli = await client.post("/v2/models/simple/infer", content=b"x", headers={"Content-Encoding": "br"})
    assert "Content-Encoding 'br' is not supported" in _error(brotli, 400)
    assert "gzip, deflate (zlib), or identity" in _error(brotli, 400)


def _counting_body(chunks: int, size: int, pulled: list[int]) -> AsyncIterator[bytes]:
    async def generate() -> AsyncIterator[bytes]:
        for _ in range(chunks):
            pulled.append(size)
            yield b" " * size
    return generate()


async def test_oversized_content_length_is_refused_before_reading(client: httpx.AsyncClient) -> None:
    pulled: list[int] = []
    response = await client.post("/v2/models/simple/infer", content=_counting_body(100, 1000, pulled),
                                 headers={"Content-Length": "100000"})
    assert _error(response) == (f"request body of 100000 bytes exceeds the limit of {LIMIT} bytes "
                                f"(--http-max-input-size)")
    assert pulled == []


async def test_oversized_streamed_body_stops_reading_at_the_limit(client: httpx.AsyncClient) -> None:
    pulled: list[int] = []
    response = await client.post("/v2/models/simple/infer", content=_counting_body(100, 1000, pulled))
    assert _error(response) == (f"request body of at least 5000 bytes exceeds the limit of {LIMIT} bytes "
                                f"(--http-max-input-size)")
    assert len(pulled) == 5


async def test_malformed_json_reports_the_position(client: httpx.AsyncClient) -> None:
    response = await client.post("/v2/models/simple/infer", content=b'{"inputs": [\n  {"name": }]}')
    assert _error(response) == ("malformed JSON in the inference request at line 2 column 12 (char 24): "
                                "unexpected character, expected a JSON value")


@pytest.mark.parametrize(
    ("blobs", "header_value", "message"),
    [
        ((b"\x00" * 64,), "100000", "Inference-Header-Content-Length is 100000 but the request body has only"),
        ((b"\x00" * 64, b"extra"), None, "model 'simple': binary data: 5 bytes follow the last binary input"),
        ((b"\x00" * 60,), None, "model 'simple': input 'INPUT0': parameters.binary_data_size is 64 but only 60"),
        ((b"\x00" * 64,), "abc", "Inference-Header-Content-Length must be a non-negative integer, got 'abc'"),
    ],
)
async def test_bad_binary_framing(client: httpx.AsyncClient, blobs: tuple[bytes, ...], header_value: str | None,
                                  message: str) -> None:
    doc = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32",
                       "parameters": {"binary_data_size": 64}}]}
    body, headers = _binary(doc, *blobs)
    if header_value is not None:
        headers["Inference-Header-Content-Length"] = header_value
    assert message in _error(await client.post("/v2/models/simple/infer", content=body, headers=headers))


async def test_binary_size_that_does_not_match_the_shape_names_the_input(client: httpx.AsyncClient) -> None:
    doc = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 60}},
                      {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}]}
    body, headers = _binary(doc, b"\x00" * 60)
    response = await client.post("/v2/models/simple/infer", content=body, headers=headers)
    assert _error(response) == ("model 'simple': input 'INPUT0': parameters.binary_data_size is 60 but shape "
                                "[1, 16] of INT32 needs 64 bytes")


# -- request errors ------------------------------------------------------------------------------------------


def _with_input(index: int, **changes: Any) -> dict[str, Any]:
    doc = _simple()
    doc["inputs"][index].update(changes)
    return doc


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (_with_input(0, shape=[1, 8], data=list(range(8))), "model 'simple': input 'INPUT0' has shape [1, 8]; "
                                                            "expected INT32 with shape [-1, 16]"),
        (_with_input(0, shape=[1, 15]), "input 'INPUT0': field 'data' has 16 elements but shape [1, 15] needs 15"),
        (_with_input(0, datatype="FP32"), "model 'simple': input 'INPUT0' has datatype FP32; expected INT32"),
        (_with_input(1, name="INPUT9"), "model 'simple': unexpected input 'INPUT9'; expected inputs: INPUT0, INPUT1"),
        ({"inputs": _simple()["inputs"][:1]}, "model 'simple': missing input(s) INPUT1"),
        (_with_input(0, data=[0.5] * 16), "input 'INPUT0': field 'data' holds non-integer numbers; INT32 expects "
                                          "integers"),
        (_simple(outputs=[{"name": "OUTPUT7"}]), "model 'simple': unknown output 'OUTPUT7' requested"),
        (_with_input(0, shape=[9, 16], data=[0] * 144), "has batch size 9; expected 1..8 (max_batch_size)"),
    ],
)
async def test_invalid_requests_are_400_with_a_precise_message(client: httpx.AsyncClient, doc: dict[str, Any],
                                                               message: str) -> None:
    assert message in _error(await client.post("/v2/models/simple/infer", json=doc))


async def test_unknown_model_and_version_are_404(client: httpx.AsyncClient) -> None:
    missing = await client.post("/v2/models/nope/infer", json=_simple())
    assert _error(missing, 404).startswith("Request for unknown model")
    version = await client.post("/v2/models/simple/versions/9/infer", json=_simple())
    assert _error(version, 404).startswith("Request for unknown model")


async def test_bf16_binary_output(client: httpx.AsyncClient) -> None:
    h = np.array([1.5, -2], dtype=ml_dtypes.bfloat16)
    doc = {"inputs": [{"name": "B", "shape": [2], "datatype": "BOOL", "data": [True, True]},
                      {"name": "H", "shape": [2], "datatype": "BF16", "parameters": {"binary_data_size": 4}},
                      {"name": "U", "shape": [2], "datatype": "UINT8", "data": [1, 2]}],
           "outputs": [{"name": "H_OUT", "parameters": {"binary_data": True}}]}
    body, headers = _binary(doc, h.tobytes())
    header, blob = _split(await client.post("/v2/models/mixed/infer", content=body, headers=headers))
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 4}
    assert blob == h.tobytes()


async def test_inference_skips_starlette_and_everything_else_goes_through_it(server: Server) -> None:
    """InferFirst answers inference itself: in front of a Starlette app with no routes, infer still works, a
    version's infer too, and any other request reaches the (empty) app."""
    from starlette.applications import Starlette

    from kiln.frontends.http.app import InferFirst, _guarded
    from kiln.frontends.http.endpoints import Endpoints

    app = InferFirst(Starlette(), _guarded(Endpoints(server, LIMIT).infer))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kiln") as http:
        answer = await http.post("/v2/models/simple/infer", json=_simple())
        versioned = await http.post("/v2/models/simple/versions/1/infer", json=_simple())
        unknown = await http.post("/v2/models/nope/infer", json=_simple())
        other = await http.get("/v2/models/simple/infer")
        health = await http.get("/v2/health/ready")
    sums = {o["name"]: o["data"] for o in answer.json()["outputs"]}
    assert answer.status_code == 200 and sums["OUTPUT0"] == [i + 1 for i in range(16)]
    assert versioned.status_code == 200 and versioned.json()["model_version"] == "1"
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]  # the guarded endpoint's error
    assert other.status_code == 404 and health.status_code == 404  # Starlette's, from the app without routes
