"""`kiln serve --http-workers 2 --grpc-workers 2` answering bursts of concurrent requests, which the workers join
into one request per burst for the server process (kiln.v2.joined): the official tritonclient (HTTP and gRPC, asyncio)
gets every request's own rows and id back, binary or JSON as it asked, and the server's statistics count every
client request once."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc.aio as grpc_aio
import tritonclient.http.aio as http_aio
import tritonclient.utils.shared_memory as shm
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from kiln.testing.serve import KilnProcess, kiln_serve

ECHO = """name: "echo"
backend: "identity"
max_batch_size: 16
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { }
"""
BURST = 24
ROUNDS = 5
MAX_ROUNDS = 40  # bursts of perf_analyzer-like gRPC requests sent before one must have been joined


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    root = tmp_path_factory.mktemp("repo")
    (root / "echo" / "1").mkdir(parents=True)
    (root / "echo" / "config.pbtxt").write_text(ECHO)
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with kiln_serve([Path(root)], "--http-workers", "2", "--grpc-workers", "2", "--allow-client-shm",
                    log_path=log) as process:
        yield process


def _rows(index: int) -> np.ndarray:
    rows = 1 + index % 3
    return (np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) + 1000 * index).astype(np.float32)


def _success(stats: dict) -> int:  # type: ignore[type-arg]
    return int(stats["model_stats"][0]["inference_stats"]["success"]["count"])


async def _http_bursts(url: str) -> list[str]:
    wrong: list[str] = []
    async with http_aio.InferenceServerClient(url, conn_limit=BURST) as client:
        async def one(index: int) -> None:
            data = _rows(index)
            tensor = http_aio.InferInput("INPUT0", list(data.shape), "FP32")
            tensor.set_data_from_numpy(data, binary_data=index % 2 == 0)
            outputs = None if index % 4 == 0 else [http_aio.InferRequestedOutput("OUTPUT0",
                                                                                 binary_data=index % 4 == 1)]
            result = await client.infer("echo", [tensor], outputs=outputs, request_id=f"h{index}")
            got = result.as_numpy("OUTPUT0")
            if got is None or not np.array_equal(got, data) or result.get_response()["id"] != f"h{index}":
                wrong.append(f"request {index}: {got}")

        before = _success(await client.get_inference_statistics("echo"))
        for round_ in range(ROUNDS):
            await asyncio.gather(*(one(round_ * BURST + i) for i in range(BURST)))
        counted = _success(await client.get_inference_statistics("echo")) - before
    if counted != BURST * ROUNDS:
        wrong.append(f"statistics counted {counted} requests, {BURST * ROUNDS} were sent")
    return wrong


async def _grpc_bursts(url: str) -> list[str]:
    wrong: list[str] = []
    async with grpc_aio.InferenceServerClient(url) as client:
        async def one(index: int) -> None:
            data = _rows(index)
            tensor = grpc_aio.InferInput("INPUT0", list(data.shape), "FP32")
            tensor.set_data_from_numpy(data)
            result = await client.infer("echo", [tensor], request_id=f"g{index}")
            got = result.as_numpy("OUTPUT0")
            if got is None or not np.array_equal(got, data) or result.get_response().id != f"g{index}":
                wrong.append(f"request {index}: {got}")

        before = (await client.get_inference_statistics("echo", as_json=True))
        for round_ in range(ROUNDS):
            await asyncio.gather(*(one(round_ * BURST + i) for i in range(BURST)))
        after = (await client.get_inference_statistics("echo", as_json=True))
    counted = int(after["model_stats"][0]["inference_stats"]["success"]["count"]) \
        - int(before["model_stats"][0]["inference_stats"]["success"].get("count", 0))
    if counted != BURST * ROUNDS:
        wrong.append(f"statistics counted {counted} requests, {BURST * ROUNDS} were sent")
    return wrong


def test_http_bursts_through_the_workers_get_their_own_rows_and_ids(served: KilnProcess) -> None:
    assert asyncio.run(_http_bursts(served.http_url)) == []


def test_grpc_bursts_through_the_workers_get_their_own_rows_and_ids(served: KilnProcess) -> None:
    assert asyncio.run(_grpc_bursts(served.grpc_url)) == []


ROW_BYTES = 4 * 4
WINDOW = 3 * ROW_BYTES  # room for the most rows _rows gives


async def _bursts_in_shared_memory(client: Any, aio: Any, tag: str, joined: Callable[[], float]) -> list[str]:
    """Bursts whose inputs and outputs are windows of two regions (one of each, as perf_analyzer's
    `--shared-memory system` uses them): each request must find its own rows in its own output window. Bursts go
    on past ``ROUNDS`` until ``joined()`` counts a joined request (a burst reaching a worker over turns is not
    always joined), at most ``MAX_ROUNDS``."""
    wrong: list[str] = []
    key = f"/kiln-joined-{tag}-{os.getpid()}"
    size = BURST * WINDOW
    handles = [shm.create_shared_memory_region(f"{tag}-{side}", f"{key}-{side}", size) for side in ("in", "out")]
    try:
        for side in ("in", "out"):
            await client.register_system_shared_memory(f"{tag}-{side}", f"{key}-{side}", size)

        async def one(slot: int, index: int) -> None:
            data = _rows(index)
            tensor = aio.InferInput("INPUT0", list(data.shape), "FP32")
            tensor.set_shared_memory(f"{tag}-in", data.nbytes, offset=slot * WINDOW)
            output = aio.InferRequestedOutput("OUTPUT0")
            output.set_shared_memory(f"{tag}-out", WINDOW, offset=slot * WINDOW)
            try:
                await client.infer("echo", [tensor], outputs=[output], request_id=f"{tag}{index}")
            except InferenceServerException as exc:
                wrong.append(f"request {index}: {exc}")
                return
            got = shm.get_contents_as_numpy(handles[1], np.float32, list(data.shape), offset=slot * WINDOW)
            if not np.array_equal(got, data):
                wrong.append(f"request {index}: {got.tolist()}")

        for round_ in range(MAX_ROUNDS):
            if round_ >= ROUNDS and joined():
                break
            indexes = [round_ * BURST + slot for slot in range(BURST)]
            for slot, index in enumerate(indexes):
                data = _rows(index)
                shm.set_shared_memory_region(handles[0], [data], offset=slot * WINDOW)
            await asyncio.gather(*(one(slot, index) for slot, index in enumerate(indexes)))
        await client.unregister_system_shared_memory()
    finally:
        for handle in handles:
            shm.destroy_shared_memory_region(handle)
    return wrong


async def _shared_memory_over(protocol: str, served: KilnProcess, joined: Callable[[], float]) -> list[str]:
    if protocol == "http":
        async with http_aio.InferenceServerClient(served.http_url, conn_limit=BURST) as client:
            return await _bursts_in_shared_memory(client, http_aio, "h", joined)
    async with grpc_aio.InferenceServerClient(served.grpc_url) as client:
        return await _bursts_in_shared_memory(client, grpc_aio, "g", joined)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bursts_in_shared_memory_are_joined_and_each_finds_its_rows_in_its_own_window(served: KilnProcess,
                                                                                       protocol: str) -> None:
    before = _joined_metrics(served.metrics_url)

    def since(name: str) -> float:
        return _joined_metrics(served.metrics_url)[name] - before[name]

    assert asyncio.run(_shared_memory_over(protocol, served,
                                           lambda: since("kiln_inference_joined_request_success"))) == []
    joined, members, success = (since(n) for n in (
        "kiln_inference_joined_request_success", "kiln_inference_joined_member_success",
        "nv_inference_request_success"))
    assert joined > 0 and 2 * joined <= members <= success, f"no burst of {BURST} was joined in {MAX_ROUNDS} rounds"


def _joined_metrics(metrics_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=10).read().decode()
    # Keyed by family: the parser reports a counter sample as <name>_total.
    return {family.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.labels.get("model") == "echo"}


def test_the_metrics_count_the_joined_requests_and_the_clients_requests_they_carried(served: KilnProcess) -> None:
    before = _joined_metrics(served.metrics_url)
    assert asyncio.run(_http_bursts(served.http_url)) == []
    after = _joined_metrics(served.metrics_url)
    joined, members, success = (after[n] - before[n] for n in (
        "kiln_inference_joined_request_success", "kiln_inference_joined_member_success",
        "nv_inference_request_success"))
    assert success == BURST * ROUNDS
    # Bursts of 24 reach two workers together: some leave joined, each join carrying at least two requests.
    assert joined > 0 and 2 * joined <= members <= success


async def _burst_asking_for_an_empty_final_response(url: str, round_: int) -> list[str]:
    """A gRPC burst carrying the parameter NVIDIA's perf_analyzer sets on every request (tritonclient refuses to set
    it, as a reserved one: the messages are built here)."""
    wrong: list[str] = []
    async with grpc.aio.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        async def one(index: int) -> None:
            data = _rows(index)
            request = service_pb2.ModelInferRequest(model_name="echo", id=f"p{index}")
            request.inputs.add(name="INPUT0", datatype="FP32", shape=data.shape)
            request.raw_input_contents.append(data.tobytes())
            request.parameters["triton_enable_empty_final_response"].bool_param = True
            response = await stub.ModelInfer(request)
            got = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(data.shape)
            if response.id != f"p{index}" or not np.array_equal(got, data):
                wrong.append(f"request {index}: {got}")

        await asyncio.gather(*(one(round_ * BURST + i) for i in range(BURST)))
    return wrong


def test_grpc_requests_asking_for_an_empty_final_response_are_joined_too(served: KilnProcess) -> None:
    # A single-response infer never reads the parameter: it does not keep a request from joining its like. One
    # channel's calls reach one worker a loop turn or so apart, so a burst is not always joined: bursts go on until
    # one is (every one of them would go unjoined if the parameter kept requests apart).
    before = _joined_metrics(served.metrics_url)
    joined = members = 0.0
    for round_ in range(MAX_ROUNDS):
        assert asyncio.run(_burst_asking_for_an_empty_final_response(served.grpc_url, round_)) == []
        after = _joined_metrics(served.metrics_url)
        joined, members = (after[n] - before[n] for n in (
            "kiln_inference_joined_request_success", "kiln_inference_joined_member_success"))
        if joined:
            break
    assert joined > 0 and 2 * joined <= members, f"no burst of {BURST} was joined in {MAX_ROUNDS} rounds"


@pytest.mark.parametrize("flags", [("--http-workers", "2"), ("--http-workers", "0", "--grpc-workers", "2")])
def test_a_bad_join_hold_stops_kiln_serve_at_start_with_its_name(tmp_path: Path, flags: tuple[str, ...]) -> None:
    (tmp_path / "echo" / "1").mkdir(parents=True)
    (tmp_path / "echo" / "config.pbtxt").write_text(ECHO)
    env = {**os.environ, "KILN_JOIN_HOLD": "two"}
    done = subprocess.run([sys.executable, "-m", "kiln.cli", "serve", "--model-repository", str(tmp_path),
                           "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", *flags],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "KILN_JOIN_HOLD is 'two'; expected a whole number" in done.stderr


def test_the_cpu_metrics_name_every_worker_of_both_frontends(served: KilnProcess) -> None:
    text = urllib.request.urlopen(f"http://{served.metrics_url}/metrics", timeout=10).read().decode()
    labels = {(family.name, sample.labels["process"]) for family in text_string_to_metric_families(text)
              if family.name in ("kiln_process_cpu_seconds", "kiln_event_loop_cpu_seconds")
              for sample in family.samples}
    processes = {"server", "http_worker_0", "http_worker_1", "grpc_worker_0", "grpc_worker_1"}
    assert labels == {(name, process) for name in ("kiln_process_cpu_seconds", "kiln_event_loop_cpu_seconds")
                      for process in processes}
