"""The gRPC frontend on a real grpc.aio server (127.0.0.1, port 0), driven by the official tritonclient (aio and
sync) and, for what tritonclient cannot send, by kiln's own stub on a raw channel."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tc_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from kiln.demo import build_demo_repository
from kiln.frontends.grpc import server as grpc_frontend
from kiln.frontends.grpc import start_grpc_server
from kiln.frontends.grpc.workers import start_grpc_workers
from kiln.server.server import Server, ServerOptions
from kiln.v2._generated import grpc_service_pb2 as pb
from kiln.v2._generated import grpc_service_pb2_grpc as pb_grpc

HOST = "127.0.0.1"


def _identity_model(root: Path, name: str, data_type: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "identity"\nmax_batch_size: 8\n'
        f'input [ {{ name: "INPUT0" data_type: {data_type} dims: [ -1 ] }} ]\n'
        f'output [ {{ name: "OUTPUT0" data_type: {data_type} dims: [ -1 ] }} ]\n'
    )


@pytest.fixture(scope="module")
def kiln_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("repo")
    build_demo_repository(root)
    _identity_model(root, "echo_bytes", "TYPE_STRING")
    _identity_model(root, "echo_fp16", "TYPE_FP16")
    server = Server(ServerOptions(repositories=[root]))
    server.start()
    yield server
    server.close()


@pytest.fixture(params=["in-process", "2 workers"])
async def url(kiln_server: Server, request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """Every test runs twice: against the frontend in this process, and against two worker processes that share
    the port and forward each call here (kiln serve --grpc-workers 2)."""
    if request.param == "in-process":
        grpc_server, port = await start_grpc_server(kiln_server, HOST, 0)
    else:
        grpc_server, port = await start_grpc_workers(kiln_server, HOST, 0, 2, grace_s=5.0,
                                                     max_message_bytes=grpc_frontend.MAX_MESSAGE_BYTES)
    yield f"{HOST}:{port}"
    await grpc_server.stop(None)


@pytest.fixture
async def client(url: str) -> AsyncIterator[tc_aio.InferenceServerClient]:
    triton = tc_aio.InferenceServerClient(url)
    yield triton
    await triton.close()


@pytest.fixture
async def stub(url: str) -> AsyncIterator[pb_grpc.GRPCInferenceServiceStub]:
    async with grpc.aio.insecure_channel(url) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def _simple_inputs(batch: int = 1) -> tuple[list[tc.InferInput], np.ndarray, np.ndarray]:
    a = np.arange(16 * batch, dtype=np.int32).reshape(batch, 16)
    b = np.full((batch, 16), 3, dtype=np.int32)
    inputs = [tc.InferInput("INPUT0", [batch, 16], "INT32"), tc.InferInput("INPUT1", [batch, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs, a, b


def _input(name: str, array: np.ndarray, datatype: str) -> tc.InferInput:
    tensor = tc.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


# -- health, metadata, configuration, statistics, index ----------------------------------------------------------


async def test_live_ready_and_server_metadata(client: tc_aio.InferenceServerClient) -> None:
    assert await client.is_server_live()
    assert await client.is_server_ready()
    assert await client.is_model_ready("simple")
    assert await client.is_model_ready("simple", "1")
    assert not await client.is_model_ready("simple", "7")
    assert not await client.is_model_ready("no_such_model")
    metadata = await client.get_server_metadata(as_json=True)
    assert metadata["name"] == "kiln"
    assert {"classification", "statistics", "model_repository"} <= set(metadata["extensions"])


async def test_model_metadata_has_the_batch_dimension(client: tc_aio.InferenceServerClient) -> None:
    metadata = await client.get_model_metadata("simple", as_json=True)
    assert metadata["name"] == "simple"
    assert metadata["versions"] == ["1"]
    assert metadata["platform"] == "onnxruntime_onnx"
    assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["inputs"]] == [
        ("INPUT0", "INT32", ["-1", "16"]),
        ("INPUT1", "INT32", ["-1", "16"]),
    ]
    assert [t["name"] for t in metadata["outputs"]] == ["OUTPUT0", "OUTPUT1"]


async def test_model_config(client: tc_aio.InferenceServerClient) -> None:
    config = (await client.get_model_config("mlp", as_json=True))["config"]
    assert config["name"] == "mlp"
    assert config["max_batch_size"] == 32
    assert config["input"][0]["name"] == "INPUT0"
    assert config["input"][0]["data_type"] == "TYPE_FP32"


async def test_statistics_count_inferences(client: tc_aio.InferenceServerClient) -> None:
    inputs, _, _ = _simple_inputs(batch=2)
    before = (await client.get_inference_statistics("simple", as_json=True))["model_stats"][0]
    await client.infer("simple", inputs)
    stats = (await client.get_inference_statistics("simple", as_json=True))["model_stats"][0]
    assert (stats["name"], stats["version"]) == ("simple", "1")
    assert int(stats["inference_count"]) == int(before.get("inference_count", 0)) + 2
    assert int(stats["execution_count"]) == int(before.get("execution_count", 0)) + 1
    assert int(stats["last_inference"]) > 0
    inference = stats["inference_stats"]
    assert int(inference["success"]["count"]) >= 1
    assert {"fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss"} <= set(
        inference)
    assert any(int(b["batch_size"]) == 2 for b in stats["batch_stats"])
    everything = await client.get_inference_statistics(as_json=True)
    assert {s["name"] for s in everything["model_stats"]} == {"echo_bytes", "echo_fp16", "mlp", "simple",
                                                               "simple_string", "mlp_pipeline", "mlp_preprocess",
                                                               "mlp_postprocess", "simple_int8", "simple_sequence",
                                                               "simple_dyna_sequence", "simple_identity",
                                                               "image_classifier", "simple_string_dyna_sequence",
                                                               "repeat_int32"}


async def test_repository_index(client: tc_aio.InferenceServerClient) -> None:
    index = (await client.get_model_repository_index(as_json=True))["models"]
    assert [(m["name"], m["version"], m["state"]) for m in index] == [
        ("echo_bytes", "1", "READY"), ("echo_fp16", "1", "READY"), ("image_classifier", "1", "READY"),
        ("mlp", "1", "READY"),
        ("mlp_pipeline", "1", "READY"), ("mlp_postprocess", "1", "READY"), ("mlp_preprocess", "1", "READY"),
        ("repeat_int32", "1", "READY"),
        ("simple", "1", "READY"), ("simple_dyna_sequence", "1", "READY"), ("simple_identity", "1", "READY"),
        ("simple_int8", "1", "READY"), ("simple_sequence", "1", "READY"), ("simple_string", "1", "READY"),
        ("simple_string_dyna_sequence", "1", "READY"),
    ]


# -- inference ---------------------------------------------------------------------------------------------------


async def test_infer_simple_raw(client: tc_aio.InferenceServerClient) -> None:
    inputs, a, b = _simple_inputs(batch=3)
    result = await client.infer("simple", inputs, request_id="req-7")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    response = result.get_response(as_json=True)
    assert (response["model_name"], response["model_version"], response["id"]) == ("simple", "1", "req-7")


async def test_infer_output_subset(client: tc_aio.InferenceServerClient) -> None:
    inputs, a, b = _simple_inputs()
    result = await client.infer("simple", inputs, outputs=[tc.InferRequestedOutput("OUTPUT1")])
    assert result.as_numpy("OUTPUT0") is None
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


async def test_infer_bytes_roundtrip(client: tc_aio.InferenceServerClient) -> None:
    data = np.array([[b"kiln", b"", b"\x00\xffbin"], [b"a", b"bb", "ü".encode()]], dtype=object)
    result = await client.infer("echo_bytes", [_input("INPUT0", data, "BYTES")])
    out = result.as_numpy("OUTPUT0")
    assert out.shape == (2, 3)
    assert out.tolist() == data.tolist()


async def test_infer_fp16_roundtrip(client: tc_aio.InferenceServerClient) -> None:
    data = np.array([[0.5, -2.25, 65504.0, 1e-3]], dtype=np.float16)
    result = await client.infer("echo_fp16", [_input("INPUT0", data, "FP16")])
    out = result.as_numpy("OUTPUT0")
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, data)


async def test_classification(client: tc_aio.InferenceServerClient) -> None:
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    plain = (await client.infer("mlp", [_input("INPUT0", x, "FP32")])).as_numpy("OUTPUT0")
    result = await client.infer("mlp", [_input("INPUT0", x, "FP32")],
                                outputs=[tc.InferRequestedOutput("OUTPUT0", class_count=3)])
    classes = result.as_numpy("OUTPUT0")
    assert classes.shape == (2, 3)
    for row, scores in zip(classes, plain, strict=True):
        indices = [int(entry.decode().split(":")[1]) for entry in row]
        assert indices == list(np.argsort(-scores, kind="stable")[:3])
        assert float(row[0].decode().split(":")[0]) == pytest.approx(float(scores.max()), abs=1e-5)


async def test_typed_contents_on_a_raw_channel(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    request = pb.ModelInferRequest(model_name="simple", id="typed")
    for name in ("INPUT0", "INPUT1"):
        tensor = request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        tensor.contents.int_contents.extend(range(16) if name == "INPUT0" else [5] * 16)
    response = await stub.ModelInfer(request)
    assert response.id == "typed"
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("OUTPUT0", "INT32", [1, 16]), ("OUTPUT1", "INT32", [1, 16])]
    assert not response.outputs[0].HasField("contents")  # responses always use raw_output_contents
    total = np.frombuffer(response.raw_output_contents[0], dtype="<i4")
    np.testing.assert_array_equal(total, np.arange(16) + 5)

    bytes_request = pb.ModelInferRequest(model_name="echo_bytes")
    bytes_request.inputs.add(name="INPUT0", datatype="BYTES", shape=[1, 2]).contents.bytes_contents.extend(
        [b"ab", b"c"])
    echoed = await stub.ModelInfer(bytes_request)
    assert echoed.raw_output_contents[0] == b"\x02\x00\x00\x00ab\x01\x00\x00\x00c"


async def test_raw_and_contents_together_is_invalid(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    request = pb.ModelInferRequest(model_name="echo_fp16")
    request.inputs.add(name="INPUT0", datatype="FP16", shape=[1, 1]).contents.fp32_contents.append(1.0)
    request.raw_input_contents.append(np.float16([1.0]).tobytes())
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ModelInfer(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "raw_input_contents" in caught.value.details()


async def test_raw_byte_size_mismatch_is_invalid(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    request = pb.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        request.raw_input_contents.append(b"\x00" * 60)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ModelInfer(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details()
    assert "'simple'" in details and "'INPUT0'" in details and "60" in details and "64" in details


async def test_unknown_model_is_not_found(client: tc_aio.InferenceServerClient) -> None:
    inputs, _, _ = _simple_inputs()
    with pytest.raises(InferenceServerException) as caught:
        await client.infer("no_such_model", inputs)
    assert caught.value.status() == "StatusCode.NOT_FOUND"
    assert "Request for unknown model" in caught.value.message()
    with pytest.raises(InferenceServerException) as metadata:
        await client.get_model_metadata("no_such_model")
    assert metadata.value.status() == "StatusCode.NOT_FOUND"


def _bad_inputs(case: str) -> list[tc.InferInput]:
    inputs, a, _ = _simple_inputs()
    if case == "shape":
        return [_input("INPUT0", np.zeros((1, 8), np.int32), "INT32"), inputs[1]]
    if case == "dtype":
        return [_input("INPUT0", a.astype(np.float32), "FP32"), inputs[1]]
    if case == "name":
        return [_input("INPUT9", a, "INT32"), inputs[1]]
    return [inputs[0]]  # missing INPUT1


@pytest.mark.parametrize(("case", "expected"), [
    ("shape", "input 'INPUT0' has shape [1, 8]"),
    ("dtype", "input 'INPUT0' has datatype FP32; expected INT32"),
    ("name", "unexpected input 'INPUT9'"),
    ("missing", "missing input(s) INPUT1"),
])
async def test_bad_request_is_invalid_argument(client: tc_aio.InferenceServerClient, case: str,
                                               expected: str) -> None:
    with pytest.raises(InferenceServerException) as caught:
        await client.infer("simple", _bad_inputs(case))
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert expected in caught.value.message()
    assert "model 'simple'" in caught.value.message()


async def test_stream_error_in_the_middle_does_not_end_it(client: tc_aio.InferenceServerClient) -> None:
    good, a, b = _simple_inputs()

    async def requests() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": "simple", "inputs": good, "request_id": "0"}
        yield {"model_name": "simple", "inputs": _bad_inputs("shape"), "request_id": "1"}
        yield {"model_name": "no_such_model", "inputs": good, "request_id": "2"}
        for i in range(3, 8):
            yield {"model_name": "simple", "inputs": good, "request_id": str(i)}

    replies = [reply async for reply in client.stream_infer(requests())]
    assert len(replies) == 8
    results = [(r.get_response().id if r is not None else None, e) for r, e in replies]
    assert [rid for rid, _ in results] == ["0", None, None, "3", "4", "5", "6", "7"]
    assert "has shape [1, 8]" in results[1][1].message()
    assert "Request for unknown model" in results[2][1].message()
    np.testing.assert_array_equal(replies[7][0].as_numpy("OUTPUT0"), a + b)


async def test_stream_cancelled_by_the_client(stub: pb_grpc.GRPCInferenceServiceStub,
                                              client: tc_aio.InferenceServerClient) -> None:
    request = pb.ModelInferRequest(model_name="echo_fp16", id="first")
    request.inputs.add(name="INPUT0", datatype="FP16", shape=[1, 2])
    request.raw_input_contents.append(np.float16([1, 2]).tobytes())
    call = stub.ModelStreamInfer()
    for _ in range(3):
        await call.write(request)
    reply = await call.read()
    assert reply.infer_response.id == "first" and not reply.error_message
    call.cancel()
    assert await client.is_server_ready()
    assert (await client.infer("echo_fp16", [_input("INPUT0", np.float16([[3]]), "FP16")])).as_numpy("OUTPUT0") == 3


async def test_sync_client_in_a_thread(url: str) -> None:
    def run() -> tuple[np.ndarray, list[tuple[str | None, str | None]], str]:
        triton = tc.InferenceServerClient(url)
        try:
            inputs, _, _ = _simple_inputs()
            total = triton.infer("simple", inputs).as_numpy("OUTPUT0")
            received: list[tuple[str | None, str | None]] = []
            triton.start_stream(lambda result, error: received.append(
                (result.get_response().id if result else None, error.message() if error else None)))
            triton.async_stream_infer("simple", inputs, request_id="a")
            triton.async_stream_infer("simple", _bad_inputs("missing"), request_id="b")
            triton.async_stream_infer("simple", inputs, request_id="c")
            triton.stop_stream()
            status = ""
            try:
                triton.infer("simple", _bad_inputs("dtype"))
            except InferenceServerException as exc:
                status = exc.status()
            return total, received, status
        finally:
            triton.close()

    total, received, status = await asyncio.to_thread(run)
    assert total.shape == (1, 16)
    assert [rid for rid, _ in received] == ["a", None, "c"]
    assert "missing input(s) INPUT1" in (received[1][1] or "")
    assert status == "StatusCode.INVALID_ARGUMENT"


# -- unsupported, limits, health ---------------------------------------------------------------------------------


async def test_load_unload_and_shared_memory_are_unimplemented(client: tc_aio.InferenceServerClient) -> None:
    calls = [
        client.load_model("simple"),
        client.unload_model("simple"),
        client.get_system_shared_memory_status(),
        client.register_system_shared_memory("region", "/kiln", 64),
        client.get_cuda_shared_memory_status(),
        client.get_trace_settings(),
        client.get_log_settings(),
    ]
    for call in calls:
        with pytest.raises(InferenceServerException) as caught:
            await call
        assert caught.value.status() == "StatusCode.UNIMPLEMENTED", caught.value.message()
        assert caught.value.message()
    assert await client.is_model_ready("simple")


async def test_message_size_limit(kiln_server: Server) -> None:
    grpc_server, port = await start_grpc_server(kiln_server, HOST, 0, max_message_bytes=4096)
    try:
        triton = tc_aio.InferenceServerClient(f"{HOST}:{port}")
        x = np.zeros((32, 64), np.float32)  # 8 KiB of data
        with pytest.raises(InferenceServerException) as caught:
            await triton.infer("mlp", [_input("INPUT0", x, "FP32")])
        assert caught.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        await triton.close()
    finally:
        await grpc_server.stop(None)


async def test_port_in_use_is_an_error(kiln_server: Server, url: str) -> None:
    with pytest.raises(OSError, match="cannot listen"):
        await start_grpc_server(kiln_server, HOST, int(url.rsplit(":", 1)[1]))


async def test_health_follows_readiness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grpc_frontend, "HEALTH_POLL_S", 0.01)
    server = Server(ServerOptions(repositories=[tmp_path]))
    server.start()
    grpc_server, port = await start_grpc_server(server, HOST, 0)
    try:
        async with grpc.aio.insecure_channel(f"{HOST}:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            serving = health_pb2.HealthCheckResponse.SERVING
            for service in ("", "inference.GRPCInferenceService"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert reply.status == serving
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == serving
            server.begin_shutdown()  # not ready any more
            assert (await asyncio.wait_for(watch.read(), 5)).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await grpc_server.stop(None)
        server.close()
