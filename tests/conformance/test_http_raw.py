"""Status codes and bodies on the wire, checked with plain httpx."""

from __future__ import annotations

import gzip
import json
import struct

import httpx
import numpy as np
import pytest

from kiln.testing.serve import KilnProcess

MAX_INPUT_SIZE = 1 << 20  # the conformance server runs with --http-max-input-size 1 MiB

pytestmark = pytest.mark.conformance

SIMPLE_JSON = {
    "inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16},
    ]
}


def url(server: KilnProcess, path: str) -> str:
    return f"http://{server.http_url}{path}"


def assert_still_serving(server: KilnProcess) -> None:
    response = httpx.post(url(server, "/v2/models/simple/infer"), json=SIMPLE_JSON)
    assert response.status_code == 200
    outputs = {o["name"]: o["data"] for o in response.json()["outputs"]}
    assert outputs["OUTPUT0"] == [i + 1 for i in range(16)]


def test_json_infer_body_shape(kiln_server: KilnProcess) -> None:
    response = httpx.post(url(kiln_server, "/v2/models/simple/infer"), json={**SIMPLE_JSON, "id": "abc"})
    body = response.json()
    assert response.status_code == 200
    assert body["model_name"] == "simple" and body["model_version"] == "1" and body["id"] == "abc"
    assert {o["name"]: (o["datatype"], o["shape"]) for o in body["outputs"]} == {
        "OUTPUT0": ("INT32", [1, 16]), "OUTPUT1": ("INT32", [1, 16])}


def test_unknown_model_is_404_with_triton_message(kiln_server: KilnProcess) -> None:
    response = httpx.post(url(kiln_server, "/v2/models/nope/infer"), json=SIMPLE_JSON)
    assert response.status_code == 404
    assert "Request for unknown model" in response.json()["error"]


def test_malformed_json_is_400(kiln_server: KilnProcess) -> None:
    response = httpx.post(url(kiln_server, "/v2/models/simple/infer"), content=b'{"inputs": [',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]
    assert_still_serving(kiln_server)


def test_bad_binary_framing_is_400(kiln_server: KilnProcess) -> None:
    header = json.dumps({"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 64}},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 64}},
    ]}).encode()
    body = header + np.zeros(16, np.int32).tobytes()  # second tensor missing
    response = httpx.post(url(kiln_server, "/v2/models/simple/infer"), content=body,
                          headers={"Inference-Header-Content-Length": str(len(header)),
                                   "content-type": "application/octet-stream"})
    assert response.status_code == 400 and response.json()["error"]
    too_long = httpx.post(url(kiln_server, "/v2/models/simple/infer"), content=header,
                          headers={"Inference-Header-Content-Length": str(len(header) + 10)})
    assert too_long.status_code == 400 and too_long.json()["error"]
    assert_still_serving(kiln_server)


def test_oversized_body_is_400_without_reading_it(kiln_server: KilnProcess) -> None:
    body = b"x" * (MAX_INPUT_SIZE + 1)
    response = httpx.post(url(kiln_server, "/v2/models/simple/infer"), content=body)
    assert response.status_code == 400
    assert str(MAX_INPUT_SIZE) in response.json()["error"]

    def chunks() -> object:
        for _ in range(MAX_INPUT_SIZE // 65536 + 2):
            yield b"y" * 65536

    streamed = httpx.post(url(kiln_server, "/v2/models/simple/infer"), content=chunks())  # type: ignore[arg-type]
    assert streamed.status_code == 400
    assert_still_serving(kiln_server)


def test_gzip_request_body(kiln_server: KilnProcess) -> None:
    response = httpx.post(url(kiln_server, "/v2/models/simple/infer"), content=gzip.compress(json.dumps(
        SIMPLE_JSON).encode()), headers={"content-encoding": "gzip", "content-type": "application/json"})
    assert response.status_code == 200


def test_binary_output_framing(kiln_server: KilnProcess) -> None:
    request = {**SIMPLE_JSON, "parameters": {"binary_data_output": True}}
    response = httpx.post(url(kiln_server, "/v2/models/simple/infer"), json=request)
    assert response.status_code == 200
    header_length = int(response.headers["Inference-Header-Content-Length"])
    header = json.loads(response.content[:header_length])
    sizes = [o["parameters"]["binary_data_size"] for o in header["outputs"]]
    assert sizes == [64, 64] and len(response.content) == header_length + 128
    first = np.frombuffer(response.content[header_length:header_length + 64], dtype="<i4")
    assert first.tolist() == [i + 1 for i in range(16)]
    assert struct.calcsize("<16i") == 64


def test_query_parameters_are_tolerated(kiln_server: KilnProcess) -> None:
    assert httpx.get(url(kiln_server, "/v2/health/ready?verbose=1")).status_code == 200


def test_unknown_path_and_wrong_method(kiln_server: KilnProcess) -> None:
    missing = httpx.get(url(kiln_server, "/v2/nothing/here"))
    assert missing.status_code == 404 and missing.json() == {"error": "Not Found"}
    assert httpx.get(url(kiln_server, "/v2/models/simple/infer")).status_code == 405


def test_model_not_ready_and_version_not_found(kiln_server: KilnProcess) -> None:
    assert httpx.get(url(kiln_server, "/v2/models/nope/ready")).status_code == 400
    assert httpx.get(url(kiln_server, "/v2/models/simple/versions/1/ready")).status_code == 200
    response = httpx.post(url(kiln_server, "/v2/models/simple/versions/9/infer"), json=SIMPLE_JSON)
    assert response.status_code == 404


def test_repository_index_and_unsupported_load(kiln_server: KilnProcess) -> None:
    index = httpx.post(url(kiln_server, "/v2/repository/index"), json={}).json()
    assert {"name": "simple", "version": "1", "state": "READY", "reason": ""} in index
    load = httpx.post(url(kiln_server, "/v2/repository/models/simple/load"))
    assert load.status_code == 501 and load.json()["error"]


def test_metrics_endpoint(kiln_server: KilnProcess) -> None:
    assert_still_serving(kiln_server)
    text = httpx.get(f"http://{kiln_server.metrics_url}/metrics").text
    assert 'nv_inference_count{model="simple",version="1"}' in text
    assert "nv_inference_request_success" in text
    assert "# TYPE nv_inference_count counter" in text and "nv_inference_count_total" not in text
