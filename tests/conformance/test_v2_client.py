"""kiln's own V2 client (blocking and asyncio, HTTP and gRPC) against `kiln serve`, checked against what the
official tritonclient receives for the same request."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as triton_http

from kiln.demo import build_demo_repository
from kiln.errors import InvalidArgumentError, NotFoundError
from kiln.testing.serve import KilnProcess, free_port, kiln_serve
from kiln.v2.client import AsyncHttpClient, HttpClient, ServerUnreachableError
from kiln.v2.client.grpc import AsyncGrpcClient, GrpcClient

pytestmark = pytest.mark.conformance

A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)


def triton_answer(server: KilnProcess) -> dict[str, np.ndarray]:
    client = triton_http.InferenceServerClient(server.http_url)
    inputs = [triton_http.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    for tensor, array in zip(inputs, (A, B), strict=True):
        tensor.set_data_from_numpy(array)
    result = client.infer("simple", inputs)
    client.close()
    return {name: result.as_numpy(name) for name in ("OUTPUT0", "OUTPUT1")}


def assert_same(outputs: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert set(outputs) == set(expected)
    for name, array in expected.items():
        assert outputs[name].dtype == array.dtype and outputs[name].tolist() == array.tolist()


@pytest.mark.parametrize("binary", [True, False])
def test_http_client_infers_as_tritonclient_does(kiln_server: KilnProcess, binary: bool) -> None:
    with HttpClient(kiln_server.http_url) as client:
        response = client.infer("simple", {"INPUT0": A, "INPUT1": B}, binary=binary, request_id="r1")
        assert (response.model_name, response.id) == ("simple", "r1")
        assert_same(response.arrays(), triton_answer(kiln_server))
        only = client.infer("simple", {"INPUT0": A, "INPUT1": B}, outputs=["OUTPUT1"], binary=binary)
        assert list(only.arrays()) == ["OUTPUT1"]


def test_http_client_reads_health_metadata_config_stats_and_index(kiln_server: KilnProcess) -> None:
    with HttpClient(kiln_server.http_url) as client:
        assert client.live() and client.ready() and client.model_ready("simple")
        assert not client.model_ready("no_such_model")
        assert client.server_metadata()["name"] == "kiln"
        assert [t["name"] for t in client.model_metadata("simple")["inputs"]] == ["INPUT0", "INPUT1"]
        assert client.model_config("simple")["max_batch_size"] == 8
        client.infer("simple", {"INPUT0": A, "INPUT1": B})
        stats = client.statistics("simple")["model_stats"]
        assert stats and stats[0]["inference_stats"]["success"]["count"] >= 1
        assert any(entry["name"] == "simple" for entry in client.repository_index(ready_only=True))


def test_http_client_raises_the_servers_typed_errors(kiln_server: KilnProcess) -> None:
    with HttpClient(kiln_server.http_url) as client:
        with pytest.raises(NotFoundError, match="no_such_model"):
            client.infer("no_such_model", {"INPUT0": A})
        with pytest.raises(InvalidArgumentError, match="INPUT0"):
            client.infer("simple", {"INPUT0": A.astype(np.float32), "INPUT1": B})
        assert client.ready()  # the connection survives error answers


def test_http_client_round_trips_bytes_tensors(kiln_server: KilnProcess) -> None:
    data = np.array([[b"kiln", b"", "é".encode()]], dtype=object)
    with HttpClient(kiln_server.http_url) as client:
        for binary in (True, False):
            out = client.infer("identity_bytes", {"INPUT0": data}, binary=binary).arrays()["OUTPUT0"]
            assert out.tolist() == data.tolist()


def test_clients_say_when_nothing_listens() -> None:
    url = f"127.0.0.1:{free_port()}"
    with HttpClient(url, timeout_s=2) as client, pytest.raises(ServerUnreachableError, match=url):
        client.ready()
    with GrpcClient(url, timeout_s=2) as grpc_client, pytest.raises(ServerUnreachableError):
        grpc_client.ready()


def test_async_http_client_serves_concurrent_tasks(kiln_server: KilnProcess) -> None:
    expected = triton_answer(kiln_server)

    async def run() -> None:
        async with AsyncHttpClient(kiln_server.http_url) as client:
            assert await client.ready()
            responses = await asyncio.gather(*(client.infer("simple", {"INPUT0": A, "INPUT1": B})
                                               for _ in range(8)))
            for response in responses:
                assert_same(response.arrays(), expected)
            with pytest.raises(NotFoundError):
                await client.model_metadata("no_such_model")

    asyncio.run(run())


def test_grpc_clients_infer_as_tritonclient_does(kiln_server: KilnProcess) -> None:
    expected = triton_answer(kiln_server)
    with GrpcClient(kiln_server.grpc_url) as client:
        assert client.ready() and client.model_ready("simple")
        assert_same(client.infer("simple", {"INPUT0": A, "INPUT1": B}).arrays(), expected)
        assert [t.name for t in client.model_metadata("simple").inputs] == ["INPUT0", "INPUT1"]
        with pytest.raises(NotFoundError):
            client.infer("no_such_model", {"INPUT0": A})
        assert client.statistics("simple").model_stats[0].name == "simple"

    async def run() -> None:
        async with AsyncGrpcClient(kiln_server.grpc_url) as client:
            responses = await asyncio.gather(*(client.infer("simple", {"INPUT0": A, "INPUT1": B})
                                               for _ in range(4)))
            for response in responses:
                assert_same(response.arrays(), expected)
            with pytest.raises(InvalidArgumentError):
                await client.infer("simple", {"INPUT0": A})

    asyncio.run(run())


def test_the_readme_client_example_runs(kiln_server: KilnProcess) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Talking to a server from Python", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert block is not None
    code = block.group(1).replace('"localhost:8000"', repr(kiln_server.http_url))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "[[ 0  2  4" in run.stdout


def test_clients_load_and_unload_models_in_explicit_mode(tmp_path: Path) -> None:
    build_demo_repository(tmp_path / "repo")
    with kiln_serve([tmp_path / "repo"], "--model-control-mode", "explicit", "--exit-timeout-secs", "5") as server:
        with HttpClient(server.http_url) as client:
            assert not client.model_ready("simple")
            client.load_model("simple")
            assert client.model_ready("simple")
            with pytest.raises(NotFoundError):
                client.load_model("no_such_model")

        async def run() -> None:
            async with AsyncHttpClient(server.http_url) as client:
                await client.unload_model("simple")
                assert not await client.model_ready("simple")
                await client.load_model("mlp")
                assert await client.model_ready("mlp")

        asyncio.run(run())
