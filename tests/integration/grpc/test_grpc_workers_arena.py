"""ModelInfer through gRPC workers (kiln serve --grpc-workers): decoded in the worker, input tensors handed to the
server process in the worker's shared-memory arena, outputs answered in the server process's arena. Checked
against the frontend in this process over the same Server: the same answers and the same errors."""

from __future__ import annotations

import asyncio
import mmap
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tc_aio
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from kiln.demo import build_demo_repository
from kiln.engines import register_backend
from kiln.frontends.grpc import server as grpc_frontend
from kiln.frontends.grpc import start_grpc_server
from kiln.frontends.grpc.workers import start_grpc_workers
from kiln.frontends.handoff.arena import Arena
from kiln.server.server import Server, ServerOptions
from kiln.service import Service, ServiceOptions
from kiln.testing.gated import ENTERED, GATE, GatedEngine
from kiln.v2.types import InferRequest

HOST = "127.0.0.1"
WORKER_MODULE = "kiln.frontends.grpc.worker"


@pytest.fixture(scope="module")
def kiln_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("repo")
    build_demo_repository(root)
    server = Server(ServerOptions(repositories=[root], allow_client_shm=True))
    server.start()
    yield server
    server.close()


async def _serve(server: Server, arena_bytes: int | None = None) -> AsyncIterator[tuple[str, str]]:
    """(two gRPC workers, the gRPC frontend in this process), both answering with ``server``."""
    extra = {} if arena_bytes is None else {"arena_bytes": arena_bytes}
    workers, port = await start_grpc_workers(server, HOST, 0, 2, grace_s=5.0,
                                             max_message_bytes=grpc_frontend.MAX_MESSAGE_BYTES, **extra)
    single, single_port = await start_grpc_server(server, HOST, 0)
    yield f"{HOST}:{port}", f"{HOST}:{single_port}"
    await single.stop(None)
    await workers.stop(None)


@pytest.fixture
async def urls(kiln_server: Server) -> AsyncIterator[tuple[str, str]]:
    async for pair in _serve(kiln_server):
        yield pair


def _root_buffer(array: np.ndarray) -> object:
    """The object at the bottom of a chain of numpy views (a memoryview's underlying object)."""
    base: Any = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def _record_inputs(server: Server, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, bool]]:
    """Have ``server.infer`` note, per request, whether each input is a view on a shared mapping (the real
    infer still answers)."""
    seen: list[dict[str, bool]] = []
    infer = server.infer

    async def noting(request: InferRequest, *args: Any, **kwargs: Any) -> Any:
        seen.append({t.name: isinstance(_root_buffer(t.data), mmap.mmap) for t in request.inputs})
        return await infer(request, *args, **kwargs)

    monkeypatch.setattr(server, "infer", noting)
    return seen


def _simple_inputs(value: int) -> tuple[list[tc.InferInput], np.ndarray]:
    a = np.full((1, 16), value, dtype=np.int32)
    b = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [tc.InferInput("INPUT0", [1, 16], "INT32"), tc.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs, a


def _tensor(name: str, array: np.ndarray, datatype: str) -> tc.InferInput:
    tensor = tc.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _worker_processes() -> list[psutil.Process]:
    return [p for p in psutil.Process().children() if WORKER_MODULE in " ".join(p.cmdline())]


async def test_inputs_arrive_in_the_server_process_as_views_on_the_workers_arena(
        kiln_server: Server, urls: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _record_inputs(kiln_server, monkeypatch)
    workers, single = urls

    def infer(url: str) -> np.ndarray:
        client = tc.InferenceServerClient(url)
        try:
            result = client.infer("simple", _simple_inputs(7)[0]).as_numpy("OUTPUT0")
        finally:
            client.close()
        assert result is not None
        return result

    np.testing.assert_array_equal(await asyncio.to_thread(infer, workers), np.full((1, 16), 7) + np.arange(16))
    np.testing.assert_array_equal(await asyncio.to_thread(infer, single), np.full((1, 16), 7) + np.arange(16))
    assert seen == [{"INPUT0": True, "INPUT1": True}, {"INPUT0": False, "INPUT1": False}]
    for worker in _worker_processes():  # each worker maps its two arenas
        assert Path(f"/proc/{worker.pid}/maps").read_text().count("memfd:kiln-arena") == 2


async def test_a_request_larger_than_the_arena_travels_inline(kiln_server: Server,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _record_inputs(kiln_server, monkeypatch)
    x = np.random.default_rng(3).standard_normal((32, 64)).astype(np.float32)  # 8 KiB, the arena has 4

    def infer(url: str) -> np.ndarray:
        client = tc.InferenceServerClient(url)
        try:
            result = client.infer("mlp", [_tensor("INPUT0", x, "FP32")]).as_numpy("OUTPUT0")
        finally:
            client.close()
        assert result is not None
        return result

    async for workers, single in _serve(kiln_server, arena_bytes=4096):
        got = await asyncio.to_thread(infer, workers)
        np.testing.assert_allclose(got, await asyncio.to_thread(infer, single), rtol=1e-6)
    assert seen[0] == {"INPUT0": False}


def _outcome(client: tc.InferenceServerClient, model: str, inputs: list[tc.InferInput],
             outputs: list[tc.InferRequestedOutput] | None = None) -> dict[str, Any]:
    """Every output as a list, or the error's status and message."""
    try:
        result = client.infer(model, inputs, outputs=outputs)
    except InferenceServerException as exc:
        return {"status": exc.status(), "message": exc.message()}
    response = result.get_response()
    return {o.name: result.as_numpy(o.name).tolist() for o in response.outputs}  # type: ignore[union-attr]


def _cases() -> list[tuple[str, list[tc.InferInput], list[tc.InferRequestedOutput] | None]]:
    simple, a = _simple_inputs(5)
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    strings = np.array([[str(i).encode() for i in range(16)]], dtype=object)
    return [
        ("simple", simple, None),
        ("simple", simple, [tc.InferRequestedOutput("OUTPUT1")]),
        ("mlp", [_tensor("INPUT0", x, "FP32")], None),
        ("mlp", [_tensor("INPUT0", x, "FP32")], [tc.InferRequestedOutput("OUTPUT0", class_count=3)]),
        ("simple_string", [_tensor("INPUT0", strings, "BYTES"), _tensor("INPUT1", strings, "BYTES")], None),
        ("simple_identity", [_tensor("INPUT0", np.array([[b"\x00\xffraw", b""]], dtype=object), "BYTES")], None),
        # errors: unknown model, a wrong shape, a wrong datatype, a missing input, a decoupled model
        ("no_such_model", simple, None),
        ("simple", [_tensor("INPUT0", np.zeros((1, 8), np.int32), "INT32"), simple[1]], None),
        ("simple", [_tensor("INPUT0", a.astype(np.float32), "FP32"), simple[1]], None),
        ("simple", simple[:1], None),
        ("repeat_int32", [_tensor("IN", np.array([1, 2], np.int32), "INT32"),
                          _tensor("DELAY", np.array([0, 0], np.uint32), "UINT32"),
                          _tensor("WAIT", np.array([0], np.uint32), "UINT32")], None),
    ]


async def test_answers_and_errors_are_those_of_one_process(urls: tuple[str, str]) -> None:
    def compare() -> None:
        workers, single = (tc.InferenceServerClient(url) for url in urls)
        try:
            outcomes = [(_outcome(workers, *case), _outcome(single, *case)) for case in _cases()]
        finally:
            workers.close()
            single.close()
        for (got, want), case in zip(outcomes, _cases(), strict=True):
            if case[0] == "mlp" and "OUTPUT0" in want and not isinstance(want["OUTPUT0"][0][0], bytes):
                np.testing.assert_allclose(got["OUTPUT0"], want["OUTPUT0"], rtol=1e-6)
            else:
                assert got == want, case[0]
        statuses = [want.get("status") for _, want in outcomes]
        assert statuses[6:] == ["StatusCode.NOT_FOUND", *["StatusCode.INVALID_ARGUMENT"] * 3,
                                "StatusCode.UNIMPLEMENTED"]
        assert "decoupled" in outcomes[-1][0]["message"]

    await asyncio.to_thread(compare)


async def test_system_shared_memory_inputs_and_outputs(urls: tuple[str, str]) -> None:
    def run() -> None:
        clients = [tc.InferenceServerClient(url) for url in urls]
        key = f"/kiln-grpc-workers-test-{time.monotonic_ns()}"
        handle = shm.create_shared_memory_region("grpc-io", key, 256)
        try:
            a = np.arange(16, dtype=np.int32).reshape(1, 16)
            shm.set_shared_memory_region(handle, [a, a * 3])
            clients[0].register_system_shared_memory("grpc-io", key, 256)  # one registry: the server process's
            inputs = [tc.InferInput("INPUT0", [1, 16], "INT32"), tc.InferInput("INPUT1", [1, 16], "INT32")]
            inputs[0].set_shared_memory("grpc-io", 64)
            inputs[1].set_shared_memory("grpc-io", 64, offset=64)
            outputs = [tc.InferRequestedOutput("OUTPUT0"), tc.InferRequestedOutput("OUTPUT1")]
            outputs[0].set_shared_memory("grpc-io", 64, offset=128)
            responses = []
            for client in clients:
                shm.set_shared_memory_region(handle, [np.zeros(16, np.int32)], offset=128)
                responses.append(client.infer("simple", inputs, outputs=outputs).get_response())
                np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=128),
                                              a * 4)
            assert responses[0] == responses[1]
            contents = responses[0].raw_output_contents  # OUTPUT0's data went into the region
            assert contents[0] == b""
            np.testing.assert_array_equal(np.frombuffer(contents[1], np.int32), (a - a * 3)[0])
            missing = [tc.InferInput("INPUT0", [1, 16], "INT32"), inputs[1]]
            missing[0].set_shared_memory("no-such-region", 64)
            answers = [_outcome(client, "simple", missing) for client in clients]
            assert answers[0] == answers[1] and answers[0]["status"] == "StatusCode.NOT_FOUND"
            clients[0].unregister_system_shared_memory("grpc-io")
        finally:
            shm.destroy_shared_memory_region(handle)
            for client in clients:
                client.close()

    await asyncio.to_thread(run)


async def test_many_concurrent_requests_get_their_own_answers(urls: tuple[str, str]) -> None:
    failures: list[str] = []

    def run(thread: int) -> None:
        client = tc.InferenceServerClient(urls[0])  # a connection each: both workers
        for round_ in range(12):
            value = thread * 100 + round_
            inputs, a = _simple_inputs(value)
            got = client.infer("simple", inputs).as_numpy("OUTPUT0")
            x = np.full((1 + round_ % 3, 64), value, np.float32)
            scores = client.infer("mlp", [_tensor("INPUT0", x, "FP32")]).as_numpy("OUTPUT0")
            if got is None or not np.array_equal(got, a + np.arange(16)) or scores is None \
                    or scores.shape != (len(x), 10) or not np.allclose(scores, scores[0]):
                failures.append(f"thread {thread} round {round_}: {got}")
        client.close()

    def all_threads() -> None:
        threads = [threading.Thread(target=run, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)

    await asyncio.to_thread(all_threads)
    assert failures == []


SLOW = """
backend: "slow_for_grpc_workers_test" max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


async def test_sigterm_drains_a_model_infer_in_flight_in_a_worker(tmp_path: Path) -> None:
    register_backend("slow_for_grpc_workers_test", GatedEngine)
    (tmp_path / "slow" / "1").mkdir(parents=True)
    (tmp_path / "slow" / "config.pbtxt").write_text(SLOW)
    service = Service(ServiceOptions(ServerOptions(repositories=[tmp_path]), http_port=0, grpc_port=0,
                                     metrics_port=0, grpc_workers=2, exit_timeout_s=20))
    GATE.clear()
    ENTERED.clear()
    run = asyncio.create_task(service.run())
    while "grpc" not in service.bound:
        await asyncio.sleep(0.01)
    client = tc_aio.InferenceServerClient(f"{HOST}:{service.bound['grpc']}")
    in_flight = asyncio.create_task(client.infer("slow", [_tensor("x", np.array([[1, 2]], np.float32), "FP32")]))
    await asyncio.to_thread(ENTERED.wait, 10)
    workers = _worker_processes()
    assert len(workers) == 2
    service.request_stop()
    await asyncio.sleep(0.3)
    assert not run.done()  # still draining
    GATE.set()
    result = await in_flight
    await client.close()
    assert result.as_numpy("y").tolist() == [[2.0, 3.0]]
    assert await asyncio.wait_for(run, 20) == 0
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, "workers outlived the server"


async def test_a_call_the_client_gave_up_on_hands_its_output_slot_back(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    register_backend("slow_for_grpc_workers_test", GatedEngine)
    (tmp_path / "slow" / "1").mkdir(parents=True)
    (tmp_path / "slow" / "config.pbtxt").write_text(SLOW)
    freed: list[int] = []
    free = Arena.free

    def noting(arena: Arena, offset: int) -> None:
        freed.append(offset)
        free(arena, offset)

    monkeypatch.setattr(Arena, "free", noting)  # in this process: the server side's response arenas only
    server = Server(ServerOptions(repositories=[tmp_path]))
    server.start()
    GATE.clear()
    ENTERED.clear()
    try:
        async for workers, _ in _serve(server):
            client = tc_aio.InferenceServerClient(workers)
            x = np.array([[1, 2]], np.float32)
            with pytest.raises(InferenceServerException, match="Deadline"):
                await client.infer("slow", [_tensor("x", x, "FP32")], client_timeout=0.3)
            assert ENTERED.is_set() and freed == []
            GATE.set()  # the server process answers now, into its arena, for a call nobody waits for
            deadline = time.monotonic() + 10
            while not freed and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert freed, "the answer's slot was never handed back"
            result = await client.infer("slow", [_tensor("x", x, "FP32")])
            assert result.as_numpy("y").tolist() == [[2.0, 3.0]]
            await client.close()
    finally:
        GATE.set()
        server.close()
