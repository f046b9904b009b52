"""The infer lane (infer_lane.py), in an HTTP worker and in the server process. A real Server; for a worker, the
server process's CoreLink and the worker's CoreClient on a socket pair; uvicorn twice, with the lane and without it.
Infer requests answered on the lane give the bytes the ASGI path gives (JSON, binary, errors; keep-alive, pipelined,
``Connection: close``), a body that arrives in pieces larger than uvicorn's high-water mark completes, requests the
lane must not take are answered the ASGI way, and an answer whose client has gone gives its arena slot back."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.frontends.access import HTTP_GROUPS, AccessPolicy, parse_restriction
from kiln.frontends.handoff.arena import Arena
from kiln.frontends.http.app import build_app
from kiln.frontends.http.core import CoreLink
from kiln.frontends.http.infer_lane import InferLane, ServerCore, lane_enabled
from kiln.frontends.http.server import HttpServer, http_config
from kiln.frontends.http.worker_app import CoreClient, WorkerApp
from kiln.server.server import Server, ServerOptions
from kiln.service import Service
from kiln.service_options import ServiceOptions

from .._arenas import all_freed, arena_pair

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="arenas need memfd_create (Linux)")

LIMIT = 1 << 20
MODEL = """name: "{name}"
backend: "identity"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
dynamic_batching {{ {batching} }}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("repo")
    # "slow" waits 0.3 s for a batch of 8 that never forms: its answer comes after its client may have gone
    for name, batching in (("echo", "max_queue_delay_microseconds: 0"),
                           ("slow", "preferred_batch_size: [ 8 ] max_queue_delay_microseconds: 300000")):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(MODEL.format(name=name, batching=batching))
    kiln_server = Server(ServerOptions(repositories=[Path(root)]))
    kiln_server.start()
    yield kiln_server
    kiln_server.close()


class Frontend:
    """An HTTP frontend under test: its lane (None: every request is an ASGI task), its port, the arenas its
    requests pass through (none in the server process)."""

    def __init__(self, lane: InferLane | None, port: int, arenas: list[Arena]) -> None:
        self.lane, self.port, self.arenas = lane, port, arenas

    async def slots_back(self) -> bool:
        return await all_freed(self.arenas, seconds=2.0)


PLACES = ["worker", "server process"]


async def _frontend(server: Server, place: str, lane: bool,
                    access: AccessPolicy | None = None) -> AsyncIterator[Frontend]:
    """uvicorn serving ``server`` as an HTTP worker does (``place`` "worker") or as the server process does."""
    access = access or AccessPolicy()
    links = []
    arenas: list[Arena] = []
    if place == "worker":
        (worker_requests, core_requests), (core_responses, worker_responses) = (arena_pair(1 << 22),
                                                                                arena_pair(1 << 22))
        link = CoreLink(server, build_app(server, max_input_size=LIMIT), core_requests, core_responses,
                        lambda: None)
        core = CoreClient(worker_requests, worker_responses)
        ours, theirs = socket.socketpair()
        loop = asyncio.get_running_loop()
        await loop.create_connection(lambda: core.protocol, sock=ours)
        await loop.create_connection(lambda: link.protocol, sock=theirs)
        links = [core.protocol, link.protocol]
        arenas = [worker_requests, core_responses]
        app: Any = WorkerApp(core, LIMIT, access)
        infer_lane = InferLane.of_worker(app) if lane else None
    else:
        app = build_app(server, max_input_size=LIMIT, access=access)
        infer_lane = InferLane(ServerCore(server), LIMIT, access) if lane else None
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(64)
    listening.setblocking(False)
    http = HttpServer(http_config(app, "", 0, 1.0, lane=infer_lane), [listening])
    serving = asyncio.create_task(http.serve())
    while not http.started:
        await asyncio.sleep(0.005)
    yield Frontend(infer_lane, listening.getsockname()[1], arenas)
    http.should_exit = True
    await serving
    for protocol in links:
        protocol.transport.close()  # type: ignore[union-attr]


@pytest.fixture(params=PLACES)
def place(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def lane(server: Server, place: str) -> AsyncIterator[Frontend]:
    async for frontend in _frontend(server, place, lane=True):
        yield frontend


@pytest.fixture
async def plain(server: Server, place: str) -> AsyncIterator[Frontend]:
    async for frontend in _frontend(server, place, lane=False):
        yield frontend


def _post(path: str, body: bytes, *headers: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "host: kiln", f"content-length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _binary(values: np.ndarray, model: str = "echo", *headers: str) -> bytes:
    doc = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, values.size], "datatype": "FP32",
                                  "parameters": {"binary_data_size": values.nbytes}}],
                      "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}).encode()
    return _post(f"/v2/models/{model}/infer", doc + values.astype(np.float32).tobytes(),
                 f"inference-header-content-length: {len(doc)}", *headers)


def _json(values: list[float], model: str = "echo", *headers: str) -> bytes:
    doc = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, len(values)], "datatype": "FP32",
                                  "data": values}]}).encode()
    return _post(f"/v2/models/{model}/infer", doc, "content-type: application/json", *headers)


async def _responses(reader: asyncio.StreamReader, count: int) -> list[tuple[list[bytes], bytes]]:
    """``count`` responses as (status line and headers but the date, body)."""
    answers = []
    for _ in range(count):
        head = (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")[:-2]
        length = next(int(line.split(b":")[1]) for line in head if line.lower().startswith(b"content-length:"))
        answers.append(([line for line in head if not line.lower().startswith(b"date:")],
                        await reader.readexactly(length)))
    return answers


async def _exchange(port: int, *requests: bytes, pieces: int = 1) -> list[tuple[list[bytes], bytes]]:
    """``requests`` on one connection, written together (pipelined), in ``pieces`` writes a little apart."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = b"".join(requests)
    step = -(-len(data) // pieces)
    for start in range(0, len(data), step):
        writer.write(data[start:start + step])
        await writer.drain()
        if pieces > 1:
            await asyncio.sleep(0.01)
    try:
        return await asyncio.wait_for(_responses(reader, len(requests)), 10)
    finally:
        writer.close()


def _status(answer: tuple[list[bytes], bytes]) -> int:
    return int(answer[0][0].split()[1])


CASES = {
    "binary": [_binary(np.arange(4, dtype=np.float32))],
    "json": [_json([1.5, 2.5, 3.5])],
    "keep-alive and pipelined": [_binary(np.arange(3, dtype=np.float32)), _json([7.0]),
                                 _binary(np.ones(5, np.float32))],
    "a wrong datatype": [_post("/v2/models/echo/infer", json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "INT32", "data": [1, 2]}]}).encode())],
    "a header length past the body": [_post("/v2/models/echo/infer", b"{}", "inference-header-content-length: 9")],
    "connection close": [_json([1.0], "echo", "connection: close")],
}


@pytest.mark.parametrize("case", CASES)
async def test_the_lane_answers_with_the_bytes_the_asgi_path_gives(lane: Frontend, plain: Frontend, case: str) -> None:
    requests = CASES[case]
    fast = await _exchange(lane.port, *requests)
    assert fast == await _exchange(plain.port, *requests)
    assert lane.lane is not None and lane.lane.taken == len(requests) - (case == "a header length past the body")
    assert _status(fast[0]) == (400 if case in ("a wrong datatype", "a header length past the body") else 200)
    if case == "binary":
        assert np.array_equal(np.frombuffer(fast[0][1][-16:], np.float32), np.arange(4))
    if case == "connection close":
        assert b"connection: close" in fast[0][0]
    assert await lane.slots_back()


@pytest.mark.parametrize(("values", "pieces"), [(75_000, 8), (250_000, 40)])  # 300 KB; 1 MB, the limit
async def test_a_body_in_pieces_above_the_high_water_mark_completes_on_the_lane(lane: Frontend, values: int,
                                                                                pieces: int) -> None:
    image = np.random.default_rng(3).standard_normal(values - 64).astype(np.float32)  # room for the JSON header
    ((head, body),) = await _exchange(lane.port, _binary(image), pieces=pieces)
    assert head[0] == b"HTTP/1.1 200 OK" and np.array_equal(np.frombuffer(body[-image.nbytes:], np.float32), image)
    assert lane.lane is not None and lane.lane.taken == 1


async def test_requests_the_lane_must_not_take_are_answered_the_asgi_way(lane: Frontend, plain: Frontend) -> None:
    compressed = gzip.compress(json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32",
                                                       "data": [4.0]}]}).encode())
    requests = [
        _post("/v2/models/nonexistent/infer", b"{not json"),  # the server process says first the model is unknown
        _post("/v2/models/echo/infer", compressed, "content-encoding: gzip"),
        _post("/v2/models/echo/infer", np.ones(2, np.float32).tobytes(), "inference-header-content-length: 0"),  # raw
        _post("/v2/models/echo/infer", b"x" * (LIMIT + 1)),  # over --http-max-input-size
        b"GET /v2/health/ready HTTP/1.1\r\nhost: kiln\r\n\r\n",
    ]
    fast = await _exchange(lane.port, *requests)
    assert fast == await _exchange(plain.port, *requests)
    assert [_status(answer) for answer in fast] == [404, 200, 200, 400, 200]
    assert lane.lane is not None and lane.lane.taken == 0


async def test_a_pipeline_of_lane_and_asgi_requests_is_answered_in_order(lane: Frontend, plain: Frontend) -> None:
    compressed = gzip.compress(json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32",
                                                       "data": [6.0]}]}).encode())
    requests = [_binary(np.arange(2, dtype=np.float32)),
                _post("/v2/models/echo/infer", compressed, "content-encoding: gzip", "content-type: application/json"),
                _json([8.0, 9.0]),
                b"GET /v2/health/ready HTTP/1.1\r\nhost: kiln\r\n\r\n",
                _json([10.0], "slow")]  # answered last though its batcher holds it longest
    fast = await _exchange(lane.port, *requests)
    assert fast == await _exchange(plain.port, *requests)
    assert [_status(answer) for answer in fast] == [200] * 5
    assert [b"6.0" in fast[1][1], b"8.0,9.0" in fast[2][1], b"10.0" in fast[4][1]] == [True] * 3
    assert lane.lane is not None and lane.lane.taken == 3
    assert await lane.slots_back()


async def test_restricted_inference_never_takes_the_lane(server: Server, place: str) -> None:
    policy = AccessPolicy([parse_restriction("inference:x-key=yes", "--http-restricted-api", HTTP_GROUPS)])
    async for frontend in _frontend(server, place, lane=True, access=policy):
        assert frontend.lane is not None and not frontend.lane.open
        denied, allowed = await _exchange(frontend.port, _json([1.0]), _json([1.0], "echo", "x-key: yes"))
        assert _status(denied) == 403 and _status(allowed) == 200 and frontend.lane.taken == 0


async def test_an_answer_whose_client_has_gone_gives_its_slot_back(lane: Frontend) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", lane.port)
    writer.write(_binary(np.arange(4, dtype=np.float32), "slow"))
    await writer.drain()
    while lane.lane is None or lane.lane.taken == 0:
        await asyncio.sleep(0.005)
    writer.close()  # gone before the batcher's 0.3 s are up
    await asyncio.sleep(0.5)
    assert await lane.slots_back()
    assert await _exchange(lane.port, _json([2.0]))  # the worker serves on


def test_the_environment_turns_the_lane_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert lane_enabled()
    for value in ("0", "off", " False "):
        monkeypatch.setenv("KILN_HTTP_INFER_LANE", value)
        assert not lane_enabled()
    monkeypatch.setenv("KILN_HTTP_INFER_LANE", "1")
    assert lane_enabled()


def test_kiln_serve_gives_the_lane_to_its_http_frontend_only(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP in the server process takes the lane (a worker's is started in worker.py); the metrics port never does,
    and ``KILN_HTTP_INFER_LANE=0`` turns it off."""
    service = Service(ServiceOptions(ServerOptions(repositories=[tmp_path])))

    def lane_of(http: HttpServer) -> InferLane | None:
        return getattr(http.config.http, "lane", None)

    assert isinstance(lane_of(service._uvicorn(object(), 0, frontend=True)), InferLane)
    assert lane_of(service._uvicorn(object(), 0)) is None
    monkeypatch.setenv("KILN_HTTP_INFER_LANE", "0")
    assert lane_of(service._uvicorn(object(), 0, frontend=True)) is None
