"""The official tritonclient, in all four flavours, against a real `kiln serve` process."""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpclient_aio
from tritonclient.utils import InferenceServerException

from kiln.testing.serve import KilnProcess

pytestmark = pytest.mark.conformance

FLAVOURS = ["http", "grpc", "http.aio", "grpc.aio"]


@dataclass
class Client:
    """One tritonclient flavour behind an awaitable call, so each test runs unchanged on all four."""

    flavour: str
    raw: Any
    module: ModuleType

    @property
    def is_grpc(self) -> bool:
        return self.flavour.startswith("grpc")

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.is_grpc and method in ("get_server_metadata", "get_model_metadata", "get_model_config",
                                       "get_inference_statistics", "get_model_repository_index"):
            kwargs.setdefault("as_json", True)
        result = getattr(self.raw, method)(*args, **kwargs)
        return await result if inspect.isawaitable(result) else result

    def input(self, name: str, data: np.ndarray, datatype: str, binary: bool = True) -> Any:
        tensor = self.module.InferInput(name, list(data.shape), datatype)
        if self.is_grpc:
            tensor.set_data_from_numpy(data)
        else:
            tensor.set_data_from_numpy(data, binary_data=binary)
        return tensor

    def output(self, name: str, binary: bool = True, class_count: int = 0) -> Any:
        if self.is_grpc:
            return self.module.InferRequestedOutput(name, class_count=class_count)
        return self.module.InferRequestedOutput(name, binary_data=binary, class_count=class_count)


@pytest.fixture(params=FLAVOURS)
async def client(request: pytest.FixtureRequest, kiln_server: KilnProcess) -> AsyncIterator[Client]:
    flavour = request.param
    if flavour == "http":
        raw: Any = httpclient.InferenceServerClient(kiln_server.http_url)
        module: ModuleType = httpclient
    elif flavour == "grpc":
        raw, module = grpcclient.InferenceServerClient(kiln_server.grpc_url), grpcclient
    elif flavour == "http.aio":
        raw, module = httpclient_aio.InferenceServerClient(kiln_server.http_url), httpclient
    else:
        raw, module = grpcclient_aio.InferenceServerClient(kiln_server.grpc_url), grpcclient
    yield Client(flavour, raw, module)
    closed = raw.close()
    if inspect.isawaitable(closed):
        await closed


def simple_inputs(client: Client, binary: bool = True, batch: int = 1) -> tuple[list[Any], np.ndarray, np.ndarray]:
    a = np.arange(16 * batch, dtype=np.int32).reshape(batch, 16)
    b = np.full((batch, 16), 3, dtype=np.int32)
    return [client.input("INPUT0", a, "INT32", binary), client.input("INPUT1", b, "INT32", binary)], a, b


async def test_health(client: Client) -> None:
    assert await client.call("is_server_live")
    assert await client.call("is_server_ready")
    assert await client.call("is_model_ready", "simple")
    assert not await client.call("is_model_ready", "no_such_model")


async def test_server_and_model_metadata(client: Client) -> None:
    server = await client.call("get_server_metadata")
    assert server["name"] == "kiln" and "binary_tensor_data" in server["extensions"]
    model = await client.call("get_model_metadata", "simple")
    assert model["name"] == "simple"
    assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in model["inputs"]] == [
        ("INPUT0", "INT32", [-1, 16]), ("INPUT1", "INT32", [-1, 16])]


@pytest.mark.parametrize("binary", [True, False])
async def test_infer_simple(client: Client, binary: bool) -> None:
    inputs, a, b = simple_inputs(client, binary, batch=2)
    outputs = [client.output("OUTPUT0", binary), client.output("OUTPUT1", binary)]
    result = await client.call("infer", "simple", inputs, outputs=outputs, request_id="req-7")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    response = result.get_response()
    assert (response.id if client.is_grpc else response["id"]) == "req-7"


async def test_infer_output_subset(client: Client) -> None:
    inputs, a, b = simple_inputs(client)
    result = await client.call("infer", "simple", inputs, outputs=[client.output("OUTPUT1")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.as_numpy("OUTPUT0") is None


@pytest.mark.parametrize("binary", [True, False])
async def test_bytes_tensors(client: Client, binary: bool) -> None:
    data = np.array([[b"kiln", b"", "ünïcode".encode(), b"\x00\x01"]], dtype=np.object_)
    inputs = [client.input("INPUT0", data, "BYTES", binary)]
    result = await client.call("infer", "identity_bytes", inputs, outputs=[client.output("OUTPUT0", binary)])
    # tritonclient hands JSON-encoded BYTES back as str (as it does with Triton); binary ones as bytes.
    received = [[v if isinstance(v, bytes) else v.encode() for v in row] for row in result.as_numpy("OUTPUT0")]
    assert received == data.tolist()


async def test_fp16_tensors(client: Client) -> None:
    data = np.array([[0.5, -2.25, 65504.0]], dtype=np.float16)
    result = await client.call("infer", "identity_fp16", [client.input("INPUT0", data, "FP16")])
    out = result.as_numpy("OUTPUT0")
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, data)


@pytest.mark.parametrize("model", ["mlp", "mlp_labeled"])
async def test_classification(client: Client, model: str) -> None:
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    plain = await client.call("infer", model, [client.input("INPUT0", x, "FP32")])
    logits = plain.as_numpy("OUTPUT0")
    result = await client.call("infer", model, [client.input("INPUT0", x, "FP32")],
                               outputs=[client.output("OUTPUT0", class_count=3)])
    classes = result.as_numpy("OUTPUT0")
    assert classes.shape == (2, 3)
    for row, logit_row in zip(classes, logits, strict=True):
        indices = [int(entry.decode().split(":")[1]) for entry in row]
        assert indices == list(np.argsort(-logit_row, kind="stable")[:3])
        if model == "mlp_labeled":
            assert [entry.decode().split(":")[2] for entry in row] == [f"class_{i}" for i in indices]


async def _expect_error(client: Client, call: Any, *fragments: str) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        await call
    message = caught.value.message()
    for fragment in fragments:
        assert fragment in message, message
    return caught.value


async def test_unknown_model(client: Client) -> None:
    inputs, _, _ = simple_inputs(client)
    error = await _expect_error(client, client.call("infer", "nope", inputs), "Request for unknown model", "'nope'")
    assert str(error.status()) in ("404", "StatusCode.NOT_FOUND")


async def test_bad_requests_get_invalid_argument_and_server_keeps_serving(client: Client) -> None:
    a = np.zeros((1, 16), dtype=np.int32)
    wrong_shape = [client.input("INPUT0", np.zeros((1, 8), np.int32), "INT32"), client.input("INPUT1", a, "INT32")]
    await _expect_error(client, client.call("infer", "simple", wrong_shape), "INPUT0", "[1, 8]", "[-1, 16]")
    wrong_dtype = [client.input("INPUT0", a.astype(np.float32), "FP32"), client.input("INPUT1", a, "INT32")]
    await _expect_error(client, client.call("infer", "simple", wrong_dtype), "INPUT0", "FP32", "INT32")
    wrong_name = [client.input("INPUT9", a, "INT32"), client.input("INPUT1", a, "INT32")]
    await _expect_error(client, client.call("infer", "simple", wrong_name), "INPUT9")
    missing = [client.input("INPUT1", a, "INT32")]
    error = await _expect_error(client, client.call("infer", "simple", missing), "missing", "INPUT0")
    assert str(error.status()) in ("400", "StatusCode.INVALID_ARGUMENT")
    inputs, x, y = simple_inputs(client)
    result = await client.call("infer", "simple", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x + y)


async def test_statistics_count_inferences(client: Client) -> None:
    before = await client.call("get_inference_statistics", "simple")
    inputs, _, _ = simple_inputs(client, batch=3)
    await client.call("infer", "simple", inputs)
    after = await client.call("get_inference_statistics", "simple")
    count = lambda stats: int(stats["model_stats"][0]["inference_count"])  # noqa: E731
    assert count(after) - count(before) >= 3
    success = after["model_stats"][0]["inference_stats"]["success"]
    assert int(success["count"]) >= 1 and int(success["ns"]) > 0


async def test_model_config(client: Client) -> None:
    config = await client.call("get_model_config", "simple")
    config = config.get("config", config)
    assert config["name"] == "simple" and int(config["max_batch_size"]) == 8
    assert [i["name"] for i in config["input"]] == ["INPUT0", "INPUT1"]
    if not client.is_grpc:
        assert config["input"][0]["dims"] == [16]  # Triton prints dims as JSON numbers
    json.dumps(config)
