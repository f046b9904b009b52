"""Restricted API groups on a real `kiln serve` (in one process, and with --http-workers 2 --grpc-workers 2),
called with the real tritonclient: a restricted group without its header (or with a wrong value) is refused with
403 / PERMISSION_DENIED naming the group and the header, with the header it is answered, and groups left open are
unaffected."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from queue import Queue
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]  # no type info
from tritonclient.utils import InferenceServerException

from kiln.testing.repo import make_repo, onnx_add_sub_model
from kiln.testing.serve import KilnProcess, kiln_serve

# tritonclient.http adds headers to the dict it is given: every call gets its own copy.
ADMIN = {"admin-key": "s3cret"}
INFER = {"infer-key": "letmein"}
RESTRICTIONS = ("--http-restricted-api", "model-repository,statistics:admin-key=s3cret",
                "--http-restricted-api", "inference:infer-key=letmein",
                "--grpc-restricted-protocol", "model-repository,statistics:admin-key=s3cret",
                "--grpc-restricted-protocol", "inference:infer-key=letmein",
                # gRPC health is restricted too (HTTP's stays open: the test harness polls readiness over it)
                "--grpc-restricted-protocol", "health:health-key=ok")


LOGS: dict[str, Path] = {}  # each served process's log, by its HTTP address


def _grpc(headers: dict[str, str]) -> dict[str, str]:
    return {f"triton-grpc-protocol-{key}": value for key, value in headers.items()}


@pytest.fixture(scope="module", params=["one process", "workers"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = make_repo(tmp_path_factory.mktemp("repo"), add_sub=onnx_add_sub_model())
    workers = ("--http-workers", "2", "--grpc-workers", "2") if request.param == "workers" else ("--http-workers", "1")
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with kiln_serve([repo], *RESTRICTIONS, *workers, log_path=log) as process:
        LOGS[process.http_url] = log
        yield process


def _inputs(module: Any) -> list[Any]:
    inputs = [module.InferInput(f"INPUT{i}", [1, 4], "FP32") for i in range(2)]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
    return inputs


def _refused(call: Any, status: str, group: str, header: str) -> None:
    with pytest.raises(InferenceServerException) as caught:
        call()
    assert caught.value.status() == status, caught.value
    message = caught.value.message()
    assert f"'{group}'" in message and f"'{header}'" in message, message


def test_http_restricted_groups_need_their_header(served: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(served.http_url)
    _refused(lambda: client.infer("add_sub", _inputs(httpclient)), "403", "inference", "infer-key")
    _refused(lambda: client.infer("add_sub", _inputs(httpclient), headers={"infer-key": "wrong"}), "403",
             "inference", "infer-key")
    _refused(lambda: client.infer("add_sub", _inputs(httpclient), headers=dict(ADMIN)), "403", "inference", "infer-key")
    _refused(lambda: client.get_model_repository_index(), "403", "model-repository", "admin-key")
    _refused(lambda: client.get_inference_statistics("add_sub"), "403", "statistics", "admin-key")
    result = client.infer("add_sub", _inputs(httpclient), headers=dict(INFER))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 4), 2.0, np.float32))
    assert [m["name"] for m in client.get_model_repository_index(headers=dict(ADMIN))] == ["add_sub"]
    assert client.get_inference_statistics("add_sub", headers=dict(ADMIN))["model_stats"]
    client.close()


def test_http_open_groups_are_unaffected(served: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(served.http_url)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("add_sub")
    assert client.get_model_metadata("add_sub")["name"] == "add_sub"
    assert client.get_model_config("add_sub")["name"] == "add_sub"
    client.close()


def test_grpc_restricted_groups_need_their_header(served: KilnProcess) -> None:
    client = grpcclient.InferenceServerClient(served.grpc_url)
    denied = "StatusCode.PERMISSION_DENIED"
    header = "triton-grpc-protocol-infer-key"
    _refused(lambda: client.infer("add_sub", _inputs(grpcclient)), denied, "inference", header)
    _refused(lambda: client.infer("add_sub", _inputs(grpcclient), headers={header: "wrong"}), denied,
             "inference", header)
    _refused(lambda: client.infer("add_sub", _inputs(grpcclient), headers=dict(INFER)), denied, "inference", header)
    _refused(lambda: client.get_model_repository_index(), denied, "model-repository",
             "triton-grpc-protocol-admin-key")
    _refused(lambda: client.is_server_live(), denied, "health", "triton-grpc-protocol-health-key")
    result = client.infer("add_sub", _inputs(grpcclient), headers=_grpc(INFER))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.zeros((1, 4), np.float32))
    assert [m.name for m in client.get_model_repository_index(headers=_grpc(ADMIN)).models] == ["add_sub"]
    assert client.get_inference_statistics("add_sub", headers=_grpc(ADMIN)).model_stats
    assert client.is_server_live(headers=_grpc({"health-key": "ok"}))
    client.close()


def test_grpc_open_groups_are_unaffected(served: KilnProcess) -> None:
    client = grpcclient.InferenceServerClient(served.grpc_url)
    assert client.get_model_metadata("add_sub").name == "add_sub"
    assert client.get_model_config("add_sub").config.name == "add_sub"
    client.close()


def _stream_one(url: str, headers: dict[str, str] | None) -> Any:
    """What the callback of one ModelStreamInfer request receives: a result or an error."""
    answers: Queue[Any] = Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(lambda result, error: answers.put(error or result), headers=headers)
    try:
        client.async_stream_infer("add_sub", _inputs(grpcclient))
    except InferenceServerException:  # the refusal may end the stream before the request is sent; the callback
        pass                          # has it either way
    answer = answers.get(timeout=30)
    client.stop_stream()
    client.close()
    return answer


def test_grpc_streaming_inference_is_restricted_too(served: KilnProcess) -> None:
    refused = _stream_one(served.grpc_url, None)
    assert isinstance(refused, InferenceServerException)
    assert "'inference'" in str(refused) and "triton-grpc-protocol-infer-key" in str(refused), refused
    answered = _stream_one(served.grpc_url, _grpc(INFER))
    np.testing.assert_array_equal(answered.as_numpy("OUTPUT0"), np.full((1, 4), 2.0, np.float32))


def test_the_grpc_health_service_is_the_health_group(served: KilnProcess) -> None:
    with grpc.insecure_channel(served.grpc_url) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        answer = stub.Check(health_pb2.HealthCheckRequest(), timeout=10,
                            metadata=[("triton-grpc-protocol-health-key", "ok")])
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_the_startup_log_names_the_restricted_groups_but_no_value(served: KilnProcess) -> None:
    # An HTTP worker may answer readiness before the last frontend has started and the summary is logged.
    deadline = time.monotonic() + 10.0
    while "ready in" not in (log := LOGS[served.http_url].read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "http: restricted API groups: model-repository,statistics need header 'admin-key'" in log, log
    assert "; health need header 'triton-grpc-protocol-health-key'" in log, log
    assert "s3cret" not in log and "letmein" not in log


def test_a_bad_restriction_stops_kiln_serve_with_the_reason(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "kiln.cli", "serve", "--model-repository", str(tmp_path),
               "--grpc-restricted-protocol", "model-repository,health:k1=v1",
               "--grpc-restricted-protocol", "metadata,health:k2=v2"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert finished.returncode != 0
    assert "'health' is given in more than one restriction" in finished.stderr, finished.stderr
