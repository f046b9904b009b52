"""The edge's V2 HTTP app in process (httpx ASGITransport, no sockets), local-only: JSON, binary and raw bodies,
the source in parameters and header, metadata, and errors in the {"error": ...} shape."""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest

import kiln
from kiln.demo.models import build_mlp
from kiln.demo.repository import render_config
from kiln.edge import EdgeRunner, Policy
from kiln.edge.http import build_edge_app
from kiln.testing.repo import write_model

X = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = build_mlp()
    return write_model(tmp_path_factory.mktemp("repo"), "mlp", model, render_config("mlp", model, 8).decode())


@pytest.fixture()
async def client(model_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    # max_prob_below=1.0 flags every row, so the reasons are never empty here.
    with EdgeRunner(model_dir, policy=Policy(mode="local-only", max_prob_below=1.0)) as runner:
        transport = httpx.ASGITransport(app=build_edge_app(runner))
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as http:
            yield http


def expected(model_dir: Path, x: np.ndarray) -> np.ndarray:
    return kiln.load(model_dir).infer({"INPUT0": x})["OUTPUT0"]


async def test_json_request_gets_json_outputs_and_the_source(client: httpx.AsyncClient, model_dir: Path) -> None:
    body = {"id": "r1", "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2, 64],
                                    "data": X.reshape(-1).tolist()}]}
    response = await client.post("/v2/models/mlp/infer", json=body)
    assert response.status_code == 200 and response.headers["kiln-source"] == "local"
    doc = response.json()
    assert doc["id"] == "r1" and doc["model_version"] == "1"
    assert doc["parameters"]["kiln_source"] == "local"
    assert doc["parameters"]["kiln_forward_reasons"] == "max probability of OUTPUT0 below 1.0 (rows 0, 1)"
    output = doc["outputs"][0]
    assert output["name"] == "OUTPUT0" and output["shape"] == [2, 10]
    np.testing.assert_allclose(np.array(output["data"]).reshape(2, 10), expected(model_dir, X), rtol=1e-6)


async def test_binary_request_gets_binary_outputs(client: httpx.AsyncClient, model_dir: Path) -> None:
    header = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2, 64],
                                     "parameters": {"binary_data_size": X.nbytes}}],
                         "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}).encode()
    response = await client.post("/v2/models/mlp/versions/1/infer", content=header + X.tobytes(),
                                 headers={"Inference-Header-Content-Length": str(len(header))})
    assert response.status_code == 200
    size = int(response.headers["inference-header-content-length"])
    doc = json.loads(response.content[:size])
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == 2 * 10 * 4
    outputs = np.frombuffer(response.content[size:], dtype=np.float32).reshape(2, 10)
    np.testing.assert_allclose(outputs, expected(model_dir, X), rtol=1e-6)


async def test_raw_binary_body_is_one_row_of_the_single_input(client: httpx.AsyncClient) -> None:
    response = await client.post("/v2/models/mlp/infer", content=X[:1].tobytes(),
                                 headers={"Inference-Header-Content-Length": "0"})
    assert response.status_code == 200
    size = int(response.headers["inference-header-content-length"])
    assert json.loads(response.content[:size])["outputs"][0]["shape"] == [1, 10]
    assert len(response.content) - size == struct.calcsize("10f")


async def test_health_metadata_and_stats(client: httpx.AsyncClient) -> None:
    assert (await client.get("/v2/health/ready")).status_code == 200
    assert (await client.get("/v2/health/live")).status_code == 200
    assert (await client.get("/v2/models/mlp/ready")).status_code == 200
    metadata = (await client.get("/v2/models/mlp")).json()
    assert metadata["versions"] == ["1"] and metadata["inputs"][0]["shape"] == [-1, 64]
    assert (await client.get("/v2")).json()["name"] == "kiln-edge"
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 64], "data": X[0].tolist()}]}
    await client.post("/v2/models/mlp/infer", json=body)
    stats = (await client.get("/v2/edge/stats")).json()
    assert stats["model"] == "mlp" and stats["mode"] == "local-only"
    assert stats["requests"] == 1 and stats["flagged"] == 1


async def test_errors_have_status_and_error_body(client: httpx.AsyncClient) -> None:
    other = await client.get("/v2/models/resnet50")
    assert other.status_code == 404 and "not served by this edge (it serves 'mlp' version 1)" in other.json()["error"]
    wrong_version = await client.post("/v2/models/mlp/versions/2/infer", json={"inputs": []})
    assert wrong_version.status_code == 404
    bad_shape = await client.post("/v2/models/mlp/infer", json={"inputs": [
        {"name": "INPUT0", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]})
    assert bad_shape.status_code == 400 and "INPUT0" in bad_shape.json()["error"]
    classification = await client.post("/v2/models/mlp/infer", json={
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 64], "data": X[0].tolist()}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 3}}]})
    assert classification.status_code == 501 and "classification" in classification.json()["error"]
    unknown = await client.get("/v2/nothing/here")
    assert unknown.status_code == 404 and "error" in unknown.json()


async def test_metadata_follows_a_swapped_in_version(model_dir: Path) -> None:
    with EdgeRunner(model_dir, policy=Policy(mode="local-only")) as runner:
        transport = httpx.ASGITransport(app=build_edge_app(runner))
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as http:
            assert (await http.get("/v2/models/mlp")).json()["versions"] == ["1"]
            runner.swap_engine(kiln.load(model_dir), "2").close()
            assert (await http.get("/v2/models/mlp")).json()["versions"] == ["2"]
