"""`kiln serve --grpc-workers 2` as a subprocess: the workers share the port, every call is counted in the one
server process, a worker that dies is replaced, and none is left after shutdown. (The whole gRPC conformance
module also runs against two workers: tests/integration/grpc/test_grpc_service.py.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.grpc as tc

from kiln.demo import build_demo_repository
from kiln.testing.serve import KilnProcess, kiln_serve

WORKER_MODULE = "kiln.frontends.grpc.worker"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    root = tmp_path_factory.mktemp("repo")
    build_demo_repository(root)
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with kiln_serve([root], "--grpc-workers", "2", log_path=log) as process:
        yield process


def _workers(process: KilnProcess) -> list[psutil.Process]:
    children = psutil.Process(process.process.pid).children()
    return [child for child in children if WORKER_MODULE in " ".join(child.cmdline())]


def _infer_simple(client: tc.InferenceServerClient, value: int) -> np.ndarray:
    a = np.full((1, 16), value, dtype=np.int32)
    inputs = [tc.InferInput("INPUT0", [1, 16], "INT32"), tc.InferInput("INPUT1", [1, 16], "INT32")]
    for tensor in inputs:
        tensor.set_data_from_numpy(a)
    result = client.infer("simple", inputs).as_numpy("OUTPUT0")
    assert result is not None
    return result


def test_calls_on_many_connections_are_answered_and_counted_once(served: KilnProcess) -> None:
    assert len(_workers(served)) == 2
    before = tc.InferenceServerClient(served.grpc_url).get_inference_statistics("simple")
    start = before.model_stats[0].inference_stats.success.count
    clients = [tc.InferenceServerClient(served.grpc_url) for _ in range(8)]  # a connection each: both workers
    for round_ in range(5):
        for i, client in enumerate(clients):
            np.testing.assert_array_equal(_infer_simple(client, i + round_), np.full((1, 16), 2 * (i + round_)))
    after = clients[0].get_inference_statistics("simple").model_stats[0].inference_stats.success.count
    assert after - start == 40
    for client in clients:
        client.close()


def test_a_worker_that_dies_is_replaced(served: KilnProcess) -> None:
    victim = _workers(served)[0]
    victim.kill()
    victim.wait(timeout=10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        alive = [w for w in _workers(served) if w.pid != victim.pid and w.is_running()]
        if len(alive) == 2:
            break
        time.sleep(0.1)
    assert len(alive) == 2, "no replacement worker was started"
    client = tc.InferenceServerClient(served.grpc_url)
    for value in range(10):  # new connections land on either worker, the replacement included
        np.testing.assert_array_equal(_infer_simple(client, value), np.full((1, 16), 2 * value))
        client.close()
        client = tc.InferenceServerClient(served.grpc_url)


def test_no_worker_outlives_the_server(tmp_path: Path) -> None:
    build_demo_repository(tmp_path / "repo")
    with kiln_serve([tmp_path / "repo"], "--grpc-workers", "2") as process:
        workers = _workers(process)
        assert len(workers) == 2
        client = tc.InferenceServerClient(process.grpc_url)
        assert client.is_server_ready()
        client.close()
    gone, alive = psutil.wait_procs(workers, timeout=15)
    assert not alive, f"workers still running after shutdown: {[w.pid for w in alive]}"
    assert process.process.returncode == 0


def test_bytes_that_are_no_request_get_invalid_argument(served: KilnProcess) -> None:
    import grpc

    with grpc.insecure_channel(served.grpc_url) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as caught:
            infer(b"\xff\xff\xff not a protobuf message")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not parse the ModelInfer request" in (caught.value.details() or "")
    assert tc.InferenceServerClient(served.grpc_url).is_server_ready()  # and the server keeps serving


def test_the_startup_log_names_the_workers(tmp_path: Path) -> None:
    build_demo_repository(tmp_path / "repo")
    log = tmp_path / "serve.log"
    with kiln_serve([tmp_path / "repo"], "--grpc-workers", "2", log_path=log) as process:
        expected = f"grpc: grpc://127.0.0.1:{process.grpc_url.rsplit(':', 1)[1]} (2 worker processes)"
        deadline = time.monotonic() + 15  # the URLs are logged just after HTTP starts answering
        while expected not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert expected in log.read_text()
