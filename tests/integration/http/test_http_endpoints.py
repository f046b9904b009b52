"""Health, metadata, config, statistics, repository and shared-memory routes, plus routing and error handling."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from kiln.demo import build_demo_repository
from kiln.frontends.http import build_app
from kiln.server.server import Server, ServerOptions
from kiln.v2.types import InferRequest, InferResponse

PIPELINE = ["image_classifier", "mlp", "mlp_pipeline", "mlp_postprocess", "mlp_preprocess",
            "repeat_int32"]  # demo models, sorted, up to the simple ones
SIMPLES = ["simple", "simple_dyna_sequence", "simple_identity", "simple_int8", "simple_sequence", "simple_string",
           "simple_string_dyna_sequence"]

_BROKEN = 'name: "broken"\nbackend: "identity"\ninput [ { name: "INPUT0" data_type: TYPE_NOPE dims: [ 1 ] } ]\n'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("repo")
    build_demo_repository(root)
    instance = Server(ServerOptions(repositories=[root]))
    instance.start()
    yield instance
    instance.close()


@pytest.fixture(scope="module")
def broken_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A repository with one model whose config does not parse: the server is live but not ready."""
    root = tmp_path_factory.mktemp("broken")
    build_demo_repository(root)
    (root / "broken" / "1").mkdir(parents=True)
    (root / "broken" / "config.pbtxt").write_text(_BROKEN)
    instance = Server(ServerOptions(repositories=[root]))
    instance.start()
    yield instance
    instance.close()


def _client(server: Server) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(server)), base_url="http://kiln")


@pytest.fixture
async def client(server: Server) -> AsyncIterator[httpx.AsyncClient]:
    async with _client(server) as http:
        yield http


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body: dict[str, str] = response.json()
    assert list(body) == ["error"]
    return body["error"]


_SIMPLE_REQUEST = {"inputs": [{"name": f"INPUT{i}", "shape": [2, 16], "datatype": "INT32", "data": [1] * 32}
                              for i in range(2)]}


# -- health and metadata -------------------------------------------------------------------------------------


async def test_health_live_and_ready(client: httpx.AsyncClient) -> None:
    for path in ("/v2/health/live", "/v2/health/ready"):
        response = await client.get(path)
        assert response.status_code == 200 and response.content == b""


async def test_not_started_server_is_neither_live_nor_ready() -> None:
    async with _client(Server(ServerOptions())) as http:
        assert _error(await http.get("/v2/health/live"), 400) == "server is not live"
        assert _error(await http.get("/v2/health/ready"), 400) == "server is not ready"


async def test_a_failed_model_makes_the_server_not_ready(broken_server: Server) -> None:
    async with _client(broken_server) as http:
        assert (await http.get("/v2/health/live")).status_code == 200
        assert _error(await http.get("/v2/health/ready"), 400) == "server is not ready"
        assert _error(await http.get("/v2/models/broken/ready"), 400) == "model 'broken' is not ready"
        infer = await http.post("/v2/models/broken/infer", json=_SIMPLE_REQUEST)
        assert _error(infer, 503).startswith("model 'broken' is not available")
        index = (await http.post("/v2/repository/index")).json()
        broken = next(entry for entry in index if entry["name"] == "broken")
        assert broken["state"] == "UNAVAILABLE" and "TYPE_NOPE" in broken["reason"]
        ready = (await http.post("/v2/repository/index", json={"ready": True})).json()
        assert [entry["name"] for entry in ready] == [*PIPELINE, *SIMPLES]


async def test_server_metadata(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/v2")).json()
    assert doc["name"] == "kiln" and isinstance(doc["version"], str)
    assert {"binary_tensor_data", "classification", "statistics", "model_repository"} <= set(doc["extensions"])


@pytest.mark.parametrize("path", ["/v2/models/simple", "/v2/models/simple/versions/1"])
async def test_model_metadata_includes_the_batch_dimension(client: httpx.AsyncClient, path: str) -> None:
    tensors = [{"name": f"{kind}{i}", "datatype": "INT32", "shape": [-1, 16]} for kind in ("INPUT", "OUTPUT")
               for i in range(2)]
    assert (await client.get(path)).json() == {"name": "simple", "versions": ["1"], "platform": "onnxruntime_onnx",
                                               "inputs": tensors[:2], "outputs": tensors[2:]}


async def test_metadata_errors(client: httpx.AsyncClient) -> None:
    assert _error(await client.get("/v2/models/nope"), 404) == "Request for unknown model: 'nope' is not found"
    assert _error(await client.get("/v2/models/simple/versions/7"), 404).startswith("Request for unknown model")
    bad_version = _error(await client.get("/v2/models/simple/versions/x"), 400)
    assert "version string 'x': a version is an integer > 0" in bad_version


async def test_model_ready(client: httpx.AsyncClient) -> None:
    assert (await client.get("/v2/models/simple/ready")).status_code == 200
    assert (await client.get("/v2/models/simple/versions/1/ready")).status_code == 200
    assert _error(await client.get("/v2/models/simple/versions/2/ready"), 400) == ("model 'simple' version 2 is "
                                                                                  "not ready")
    assert _error(await client.get("/v2/models/nope/ready"), 400) == "model 'nope' is not ready"


async def test_model_config_is_tritons_json(client: httpx.AsyncClient) -> None:
    for path in ("/v2/models/mlp/config", "/v2/models/mlp/versions/1/config"):
        doc = (await client.get(path)).json()
        assert doc["name"] == "mlp" and doc["max_batch_size"] == 32 and doc["backend"] == "onnxruntime"
        assert doc["input"][0]["name"] == "INPUT0" and doc["input"][0]["data_type"] == "TYPE_FP32"
        assert doc["input"][0]["dims"] == [64] and doc["output"][0]["dims"] == [10]
        assert doc["dynamic_batching"]["max_queue_delay_microseconds"] == 0
    assert _error(await client.get("/v2/models/nope/config"), 404).startswith("Request for unknown model")


# -- statistics ----------------------------------------------------------------------------------------------


def _stats(doc: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(s for s in doc["model_stats"] if s["name"] == name)
    return found


async def test_statistics_count_inferences(client: httpx.AsyncClient) -> None:
    before = _stats((await client.get("/v2/models/simple/stats")).json(), "simple")
    for _ in range(2):
        assert (await client.post("/v2/models/simple/infer", json=_SIMPLE_REQUEST)).status_code == 200
    assert (await client.post("/v2/models/simple/infer", json={"inputs": []})).status_code == 400
    after = _stats((await client.get("/v2/models/simple/versions/1/stats")).json(), "simple")
    assert after["version"] == "1" and after["last_inference"] > 0
    assert after["inference_count"] - before["inference_count"] == 4  # two requests of batch 2
    assert after["execution_count"] - before["execution_count"] == 2
    stats = after["inference_stats"]
    assert set(stats) == {"success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
                          "cache_hit", "cache_miss"}
    assert stats["success"]["count"] - before["inference_stats"]["success"]["count"] == 2
    assert stats["compute_infer"]["ns"] > 0 and stats["cache_hit"] == {"count": 0, "ns": 0}
    batch = next(b for b in after["batch_stats"] if b["batch_size"] == 2)
    assert set(batch) == {"batch_size", "compute_input", "compute_infer", "compute_output"}
    assert batch["compute_infer"]["count"] >= 2
    assert after["memory_usage"] == []


async def test_statistics_for_all_models_and_errors(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/v2/models/stats")).json()
    assert [s["name"] for s in doc["model_stats"]] == [*PIPELINE, *SIMPLES]
    assert _error(await client.get("/v2/models/nope/stats"), 404).startswith("Request for unknown model")


# -- repository ----------------------------------------------------------------------------------------------


async def test_repository_index(client: httpx.AsyncClient) -> None:
    expected = [{"name": name, "version": "1", "state": "READY", "reason": ""} for name in [*PIPELINE, *SIMPLES]]
    assert (await client.post("/v2/repository/index")).json() == expected
    assert (await client.post("/v2/repository/index", json={"ready": True})).json() == expected
    assert (await client.post("/v2/repository/models/index", json={"ready": False})).json() == expected
    bad = await client.post("/v2/repository/index", content=b'{"ready": ')
    assert _error(bad, 400).startswith("malformed JSON in the repository index request at line 1 column 11")
    assert "optional boolean 'ready'" in _error(await client.post("/v2/repository/index", json={"ready": 1}), 400)


@pytest.mark.parametrize("action", ["load", "unload"])
async def test_load_and_unload_are_not_implemented(client: httpx.AsyncClient, action: str) -> None:
    response = await client.post(f"/v2/repository/models/simple/{action}")
    assert f"cannot {action} 'simple': explicit model control is not enabled" in _error(response, 501)
    with_body = await client.post(f"/v2/repository/models/simple/{action}", json={"parameters": {}})
    assert with_body.status_code == 501
    assert "the body must be a JSON object" in _error(await client.post(f"/v2/repository/models/simple/{action}",
                                                                        json=[1]), 400)


@pytest.mark.parametrize(
    ("method", "path"),
    [(method, f"/v2/{kind}sharedmemory{suffix}") for kind in ("system", "cuda") for method, suffix in (
        ("GET", "/status"), ("GET", "/region/r0/status"), ("POST", "/region/r0/register"),
        ("POST", "/unregister"), ("POST", "/region/r0/unregister"))],
)
async def test_shared_memory_is_not_supported(client: httpx.AsyncClient, method: str, path: str) -> None:
    message = _error(await client.request(method, path), 501)
    if "/cuda" in path:
        assert "CUDA shared memory is disabled on this server" in message and "--allow-client-shm" in message
    else:  # system shared memory is off unless the server allows it
        assert "system shared memory is disabled on this server" in message and "--allow-client-shm" in message


# -- routing and errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/", "/v2/nothing", "/v2/models/simple/infer/more", "/v3/health/live"])
async def test_unmatched_paths_are_404(client: httpx.AsyncClient, path: str) -> None:
    assert _error(await client.get(path), 404) == "Not Found"


@pytest.mark.parametrize(("method", "path"), [("GET", "/v2/models/simple/infer"), ("POST", "/v2/health/live"),
                                              ("DELETE", "/v2/models/simple"), ("GET", "/v2/repository/index")])
async def test_wrong_method_is_405(client: httpx.AsyncClient, method: str, path: str) -> None:
    response = await client.request(method, path)
    assert _error(response, 405) == "Method Not Allowed"
    assert "allow" in response.headers


async def test_query_parameters_are_ignored(client: httpx.AsyncClient) -> None:
    assert (await client.get("/v2/health/ready?verbose=1&x")).status_code == 200
    assert (await client.get("/v2/models/simple?a=b")).json()["name"] == "simple"


async def test_unexpected_exception_is_500_and_the_server_keeps_serving(
    server: Server, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_infer = server.infer
    calls: list[str] = []

    async def flaky(request: InferRequest) -> InferResponse:
        calls.append(request.model_name)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return await real_infer(request)

    monkeypatch.setattr(server, "infer", flaky)
    with caplog.at_level(logging.ERROR, logger="kiln.frontends"):
        failed = await client.post("/v2/models/simple/infer", json=_SIMPLE_REQUEST)
    assert _error(failed, 500) == "internal error: RuntimeError: boom"
    assert any(record.exc_info for record in caplog.records)
    assert (await client.post("/v2/models/simple/infer", json=_SIMPLE_REQUEST)).status_code == 200
    assert (await client.get("/v2/health/ready")).status_code == 200


async def test_default_body_limit_is_tritons_64_mib(server: Server) -> None:
    async with _client(server) as http:
        response = await http.post("/v2/models/simple/infer", content=b"",
                                   headers={"Content-Length": str(64 * 2**20 + 1)})
    assert _error(response, 400) == ("request body of 67108865 bytes exceeds the limit of 67108864 bytes "
                                     "(--http-max-input-size)")
