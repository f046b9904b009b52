"""Requests a worker holds in the same event-loop turn, joined into one for the server process (kiln.v2.joined,
handoff/calls.py): over a real link (the HTTP worker's CoreClient and the server process's CoreLink on a socket
pair) to a real Server, each caller gets its own rows and request id, statistics and routing counts count every
member, and where the model does not batch, a chunk exceeds max_batch_size, A/B weights apply or the request is
refused, each member runs and is answered on its own."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Iterator
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import pytest

from kiln.errors import ConfigError, InternalError, InvalidArgumentError, NotFoundError, UnavailableError
from kiln.frontends.handoff import frames
from kiln.frontends.handoff.arena import Arena
from kiln.frontends.handoff.calls import (
    DEFAULT_HOLD,
    HOLD_FROM,
    HOLD_VARIABLE,
    JOIN_VARIABLE,
    MAX_HOLD_S,
    join_hold,
    joining_enabled,
)
from kiln.frontends.handoff.infer import _chunks
from kiln.frontends.handoff.tensors import decode_joined, encode_joined
from kiln.frontends.http.core import CoreLink
from kiln.frontends.http.worker_app import CoreClient
from kiln.server.server import Server, ServerOptions
from kiln.tensor import DataType
from kiln.v2.joined import join_key, slice_request, split_response
from kiln.v2.types import InferRequest, InferResponse, InputTensor, OutputTensor, RequestedOutput, SharedMemoryRef

from .._arenas import all_freed, arena_pair

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="arenas need memfd_create (Linux)")

MODEL = """name: "{name}"
backend: "identity"
max_batch_size: {max_batch}
input [ {{ name: "INPUT0" data_type: TYPE_INT32 dims: [ 3 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 3 ] }} ]
{batching}
"""
MODELS = {
    "batched": (16, "dynamic_batching { max_queue_delay_microseconds: 0 }"),
    "small": (4, "dynamic_batching { max_queue_delay_microseconds: 0 }"),
    "unbatched": (16, ""),
    # Waits for company: a batch below 4 rows runs only after 5 s.
    "patient": (16, "dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 5000000 }"),
    # Room for 4 waiting requests, which wait up to 0.2 s for a batch of 16.
    "bounded": (16, "dynamic_batching { preferred_batch_size: [ 16 ] max_queue_delay_microseconds: 200000 "
                    "default_queue_policy { max_queue_size: 4 } }"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("repo")
    for name, (max_batch, batching) in MODELS.items():
        for version in ("1", "2"):
            (root / name / version).mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(
            MODEL.format(name=name, max_batch=max_batch, batching=batching)
            + 'version_policy: { all: {} }\n')
    (root / "strings" / "1").mkdir(parents=True)  # BYTES: classification of its output fails as the model runs
    (root / "strings" / "config.pbtxt").write_text(
        'name: "strings"\nbackend: "identity"\nmax_batch_size: 16\n'
        'input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
        'dynamic_batching { max_queue_delay_microseconds: 0 }\n')
    kiln_server = Server(ServerOptions(repositories=[Path(root)], allow_client_shm=True))
    kiln_server.start()
    yield kiln_server
    kiln_server.close()


class Link:
    """A worker's CoreClient and the server process's CoreLink on one socket pair; counts the infer frames the
    server process receives by kind."""

    def __init__(self, client: CoreClient, core: CoreLink, kinds: list[int], arenas: list[Arena]) -> None:
        self.client, self.core, self.kinds, self.arenas = client, core, kinds, arenas

    async def all_slots_back(self) -> bool:
        """Whether every slot of both arenas (inputs, outputs) comes back to its writer within a few seconds."""
        return await all_freed(self.arenas)


def _infer_kinds(link: Link) -> list[int]:
    """The infer frames the server process received (not the answers' slots the worker gave back)."""
    return [kind for kind in link.kinds if kind in (frames.INFER, frames.INFER_JOINED)]


@pytest.fixture
async def link(server: Server) -> AsyncIterator[Link]:
    async for made in _link(server, join=True):
        yield made


async def _link(server: Server, join: bool, hold: int = DEFAULT_HOLD, max_hold_s: float = MAX_HOLD_S,
                hold_from: int = 1) -> AsyncIterator[Link]:
    """A worker's client and the server process's link over a socket pair. ``hold_from`` 1: the worker holds from
    its first request out, so a few requests show what holding does."""
    (worker_requests, core_requests), (core_responses, worker_responses) = arena_pair(1 << 20), arena_pair(1 << 20)
    kinds: list[int] = []

    class CountingLink(CoreLink):
        def _on_frame(self, call: int, kind: int, payload: bytes) -> None:
            kinds.append(kind)
            super()._on_frame(call, kind, payload)

    core = CountingLink(server, None, core_requests, core_responses, lambda: None)  # type: ignore[arg-type]
    client = CoreClient(worker_requests, worker_responses, join=join, hold=hold, max_hold_s=max_hold_s,
                        hold_from=hold_from)
    ours, theirs = socket.socketpair()
    loop = asyncio.get_running_loop()
    await loop.create_connection(lambda: client.protocol, sock=ours)
    await loop.create_connection(lambda: core.protocol, sock=theirs)
    yield Link(client, core, kinds, [worker_requests, core_responses])
    client.protocol.transport.close()  # type: ignore[union-attr]
    core.protocol.transport.close()  # type: ignore[union-attr]


def _request(model: str, data: np.ndarray, request_id: str = "", **fields: object) -> InferRequest:
    return InferRequest(model, [InputTensor("INPUT0", DataType.INT32, data.shape, data)], id=request_id,
                        **fields)  # type: ignore[arg-type]


def _rows(index: int, rows: int = 1) -> np.ndarray:
    return (np.arange(rows * 3, dtype=np.int32).reshape(rows, 3) + 100 * index).astype(np.int32)


async def _send(link: Link, requests: list[InferRequest]) -> list[InferResponse | BaseException]:
    """All of ``requests`` from one turn, as a worker's clients would send them; each answer copied out of the
    arena before its slot goes back."""
    async def one(request: InferRequest) -> InferResponse:
        response, release = await link.client.infer(request, None)
        try:
            outputs = [OutputTensor(o.name, o.datatype, o.shape, o.data.copy(), shared_memory=o.shared_memory)
                       for o in response.outputs]
            return InferResponse(response.model_name, response.model_version, outputs, response.id)
        finally:
            release()
    return list(await asyncio.gather(*(one(r) for r in requests), return_exceptions=True))


def _success(server: Server, model: str) -> tuple[int, int, int]:
    stats = server.model_statistics(model)
    return (sum(s.success.count for s in stats), sum(s.inference_count for s in stats),
            sum(s.execution_count for s in stats))


def _held(server: Server, model: str) -> int:
    return sum(s.held_members for s in server.model_statistics(model))


def _joined(server: Server, model: str) -> tuple[int, int]:
    stats = server.model_statistics(model)
    return sum(s.joined_requests for s in stats), sum(s.joined_members for s in stats)


async def test_requests_of_one_turn_go_as_one_and_each_gets_its_own_rows(link: Link, server: Server) -> None:
    before = _success(server, "batched")
    joined_before = _joined(server, "batched")
    routed_before = sum(v.routed for v in server.routing("batched").versions)
    sizes = [1, 2, 1, 3, 1]
    requests = [_request("batched", _rows(i, rows), f"id-{i}") for i, rows in enumerate(sizes)]
    answers = await _send(link, requests)
    # The first leaves at once, the four that followed it in the same turn as one.
    assert _infer_kinds(link) == [frames.INFER, frames.INFER_JOINED]
    for i, (answer, rows) in enumerate(zip(answers, sizes, strict=True)):
        assert isinstance(answer, InferResponse), answer
        assert answer.id == f"id-{i}" and answer.outputs[0].shape == (rows, 3)
        np.testing.assert_array_equal(answer.outputs[0].data, _rows(i, rows))
    after = _success(server, "batched")
    # Five clients' requests, eight rows, one or two executions: statistics count each client's request.
    assert (after[0] - before[0], after[1] - before[1]) == (5, 8) and after[2] - before[2] <= 2
    # The metrics' joined counters: one joined request, the four clients' requests it carried.
    assert _joined(server, "batched") == (joined_before[0] + 1, joined_before[1] + 4)
    assert sum(v.routed for v in server.routing("batched").versions) - routed_before == 5
    assert await link.all_slots_back()  # the joined input slot and the joined answer's slot, once all are done


async def test_a_lone_request_leaves_alone_and_different_shapes_do_not_join(link: Link) -> None:
    (answer,) = await _send(link, [_request("batched", _rows(7))])
    assert isinstance(answer, InferResponse) and _infer_kinds(link) == [frames.INFER]
    link.kinds.clear()
    odd = np.arange(4, dtype=np.int32).reshape(1, 4)  # wrong for the model: refused on its own
    answers = await _send(link, [_request("batched", _rows(1)), _request("batched", odd),
                                 _request("batched", _rows(2), parameters={"priority": 1})])
    assert link.kinds.count(frames.INFER) == 3
    assert isinstance(answers[0], InferResponse) and isinstance(answers[2], InferResponse)
    assert isinstance(answers[1], InvalidArgumentError) and "[1, 4]" in answers[1].message


async def test_members_of_a_model_without_dynamic_batching_run_one_by_one(link: Link, server: Server) -> None:
    before = _success(server, "unbatched")
    answers = await _send(link, [_request("unbatched", _rows(i), f"u{i}") for i in range(4)])
    assert _infer_kinds(link) == [frames.INFER, frames.INFER_JOINED]
    for i, answer in enumerate(answers):
        assert isinstance(answer, InferResponse) and answer.id == f"u{i}"
        np.testing.assert_array_equal(answer.outputs[0].data, _rows(i))
    after = _success(server, "unbatched")
    assert (after[0] - before[0], after[2] - before[2]) == (4, 4)
    assert _joined(server, "unbatched") == (0, 0)  # each member ran as a request of its own
    assert await link.all_slots_back()  # the joined input slot once every member's slice is gone


async def test_a_joined_request_over_max_batch_size_runs_in_chunks(link: Link, server: Server) -> None:
    before = _success(server, "small")
    answers = await _send(link, [_request("small", _rows(i)) for i in range(10)])
    for i, answer in enumerate(answers):
        assert isinstance(answer, InferResponse)
        np.testing.assert_array_equal(answer.outputs[0].data, _rows(i))
    after = _success(server, "small")
    assert (after[0] - before[0], after[1] - before[1]) == (10, 10)
    assert _infer_kinds(link) == [frames.INFER, frames.INFER_JOINED]
    assert 3 <= after[2] - before[2] <= 4  # the first alone, then 4 + 4 + 1 rows (the ones may share a batch)
    assert await link.all_slots_back()


async def test_a_refused_joined_request_gives_each_member_its_own_error(link: Link) -> None:
    wrong = [_request("batched", np.zeros((1, 5), np.int32), f"w{i}") for i in range(3)]
    answers = await _send(link, wrong)
    assert _infer_kinds(link) == [frames.INFER, frames.INFER_JOINED]
    for answer in answers:
        # The member's own shape, not the joined request's [3, 5].
        assert isinstance(answer, InvalidArgumentError) and "[1, 5]" in answer.message, answer
    assert await link.all_slots_back()


async def test_a_joined_request_the_model_refuses_as_it_runs_fails_each_member_once(link: Link,
                                                                                      server: Server) -> None:
    """Refused while running (not on admission): the same answer for every member, as in any dynamic batch, and
    the model neither runs again per member nor counts a member's failure twice."""
    def failures() -> int:
        return sum(s.fail.count for s in server.model_statistics("strings"))

    before = failures()
    requests = [InferRequest("strings", [InputTensor("INPUT0", DataType.BYTES, (1, 1),
                                                     np.array([[b"x"]], dtype=object))],
                             outputs=[RequestedOutput("OUTPUT0", classification=2)], id=f"s{i}")
                for i in range(5)]
    answers = await _send(link, requests)
    assert _infer_kinds(link) == [frames.INFER, frames.INFER_JOINED]
    for answer in answers:
        assert isinstance(answer, InvalidArgumentError) and "classification needs a numeric output" in answer.message
    assert failures() - before == 5
    assert await link.all_slots_back()


async def test_a_joined_request_counts_its_members_against_max_queue_size(link: Link) -> None:
    """Six clients' requests for a queue with room for four: as many are refused as would have been unjoined,
    each with its own error (UNAVAILABLE, as a client sees it), and the others are answered."""
    answers = await _send(link, [_request("bounded", _rows(i), f"b{i}") for i in range(6)])
    assert _infer_kinds(link)[:2] == [frames.INFER, frames.INFER_JOINED]
    refused = [a for a in answers if isinstance(a, UnavailableError)]
    answered = [a for a in answers if isinstance(a, InferResponse)]
    assert len(refused) + len(answered) == 6, answers
    # The lone first one may have run before the rest arrived: then four of the five fit, else three.
    assert 1 <= len(refused) <= 2 and all("max_queue_size" in e.message for e in refused)
    for answer in answered:
        np.testing.assert_array_equal(answer.outputs[0].data, _rows(int(answer.id[1:])))
    assert await link.all_slots_back()


async def test_ab_weights_route_each_member_on_its_own(link: Link, server: Server) -> None:
    server.set_routing("batched", weights={"1": 0.5, "2": 0.5})
    try:
        before = {v.version: v.routed for v in server.routing("batched").versions}
        answers = await _send(link, [_request("batched", _rows(i)) for i in range(40)])
        assert all(isinstance(a, InferResponse) for a in answers)
        after = {v.version: v.routed for v in server.routing("batched").versions}
        counts = {v: after[v] - before.get(v, 0) for v in after}
        assert sum(counts.values()) == 40 and all(counts.get(v, 0) > 0 for v in ("1", "2")), counts
    finally:
        server.set_routing("batched", weights={})


async def test_a_member_whose_client_went_away_leaves_the_others_their_answers(link: Link) -> None:
    requests = [_request("batched", _rows(i)) for i in range(4)]
    tasks = [asyncio.create_task(link.client.infer(r, None)) for r in requests]
    await asyncio.sleep(0)  # every request is in the worker's hands; the joined request has left
    tasks[1].cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[1], asyncio.CancelledError)
    for i in (0, 2, 3):
        response, release = done[i]  # type: ignore[misc]
        np.testing.assert_array_equal(response.outputs[0].data, _rows(i))
        del response
        release()
    assert await link.all_slots_back()  # the answer's slot once the three live answers are encoded


async def test_with_joining_off_every_request_leaves_on_its_own(server: Server) -> None:
    async for unjoined in _link(server, join=False):
        answers = await _send(unjoined, [_request("batched", _rows(i)) for i in range(4)])
        assert all(isinstance(a, InferResponse) for a in answers)
        assert _infer_kinds(unjoined) == [frames.INFER] * 4


async def _one_per_turn(link: Link, requests: list[InferRequest],
                        pause: bool = False) -> list[InferResponse | BaseException]:
    """The first request, then each of the others in a turn of its own, as requests reach a worker from the
    network one by one while the first is in flight. ``pause``: the server process reads nothing until all are in
    the worker's hands, so the first is still in flight however fast the model is."""
    transport = link.core.protocol.transport
    if pause:
        transport.pause_reading()  # type: ignore[union-attr]
    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(_send(link, [request])))
        for _ in range(3):  # the request's turn and its flush
            await asyncio.sleep(0)
    if pause:
        transport.resume_reading()  # type: ignore[union-attr]
    return [answer for (answer,) in await asyncio.gather(*tasks)]


async def _burst_first(link: Link, model: str) -> None:
    """Requests of one turn, joined: the worker learns from the answer whether the model ran them as one batch."""
    answers = await _send(link, [_request(model, _rows(i)) for i in range(3)])
    assert all(isinstance(a, InferResponse) for a in answers), answers
    assert _infer_kinds(link) == [frames.INFER, frames.INFER_JOINED]
    link.kinds.clear()


@pytest.mark.parametrize(("hold", "hold_from", "model", "kinds"), [
    (1, 1, "batched", [frames.INFER, frames.INFER_JOINED]),
    (0, 1, "batched", [frames.INFER] * 4),  # holding off: each leaves at the end of its turn
    (1, 1, "unbatched", [frames.INFER] * 4),  # its members run one by one: a held group would wait for the slowest
    # Fewer than HOLD_FROM requests out (the default): each leaves at the end of its turn, for the batch forming.
    (1, HOLD_FROM, "batched", [frames.INFER] * 4),
])
async def test_requests_that_come_one_per_turn_are_held_while_their_model_has_calls_in_flight(
        server: Server, hold: int, hold_from: int, model: str, kinds: list[int]) -> None:
    async for held in _link(server, join=True, hold=hold, max_hold_s=60, hold_from=hold_from):  # however slow
        await _burst_first(held, model)
        held_before = _held(server, model)
        answers = await _one_per_turn(held, [_request(model, _rows(i), f"h{i}") for i in range(4)], pause=True)
        for i, answer in enumerate(answers):
            assert isinstance(answer, InferResponse) and answer.id == f"h{i}", answer
            np.testing.assert_array_equal(answer.outputs[0].data, _rows(i))
        # Held: the three that came while the first ran leave together once it is answered.
        assert _infer_kinds(held) == kinds
        # The statistics count the clients' requests a worker held (kiln_inference_held_member_success).
        assert _held(server, model) - held_before == (3 if frames.INFER_JOINED in kinds else 0)
        assert await held.all_slots_back()


@pytest.mark.parametrize(("model", "second_kinds"), [
    ("batched", [frames.INFER, frames.INFER_JOINED]),
    ("unbatched", [frames.INFER] * 4),  # the first held group was answered member by member: no more holding
])
async def test_a_model_not_seen_yet_is_held_and_its_first_answer_tells_whether_to_hold_again(
        server: Server, model: str, second_kinds: list[int]) -> None:
    """Requests that only ever come one per turn (as grpc.aio hands them over) never join on their own: without
    holding the key it has not seen, a worker would never learn that the model batches them."""
    async for held in _link(server, join=True, hold=1, max_hold_s=60, hold_from=1):
        for kinds in ([frames.INFER, frames.INFER_JOINED], second_kinds):
            answers = await _one_per_turn(held, [_request(model, _rows(i), f"n{i}") for i in range(4)], pause=True)
            for i, answer in enumerate(answers):
                assert isinstance(answer, InferResponse) and answer.id == f"n{i}", answer
                np.testing.assert_array_equal(answer.outputs[0].data, _rows(i))
            assert _infer_kinds(held) == kinds
            held.kinds.clear()
        assert await held.all_slots_back()


async def test_held_requests_leave_after_max_hold_for_a_batcher_that_waits_for_them(server: Server) -> None:
    """The first call waits in the batcher for the rows the worker holds; the hold ends after max_hold_s, so the
    batch fills and runs without the 5 s queue delay."""
    async for held in _link(server, join=True, hold=1, max_hold_s=0.1):  # the requests are all in by then
        await _send(held, [_request("patient", _rows(i)) for i in range(4)])  # 4 rows: no delay; learnt: it batches
        held.kinds.clear()
        started = asyncio.get_running_loop().time()
        answers = await _one_per_turn(held, [_request("patient", _rows(i)) for i in range(4)])
        assert all(isinstance(a, InferResponse) for a in answers), answers
        assert asyncio.get_running_loop().time() - started < 2.5
        assert _infer_kinds(held) == [frames.INFER, frames.INFER_JOINED]


async def test_held_requests_fail_as_unavailable_when_the_link_closes(server: Server) -> None:
    async for held in _link(server, join=True, hold=1):
        await _send(held, [_request("patient", _rows(i)) for i in range(4)])  # learnt: it batches
        first = asyncio.create_task(_send(held, [_request("patient", _rows(0))]))  # waits 5 s for company
        await asyncio.sleep(0)
        second = asyncio.create_task(_send(held, [_request("patient", _rows(1))]))
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # its flush held it: one call of its model in flight
        held.client.protocol.transport.close()  # type: ignore[union-attr]
        for task in (first, second):
            (answer,) = await asyncio.wait_for(task, 2)
            assert isinstance(answer, UnavailableError), answer
    # The first request still waits in the batcher for company: three more rows run it now, not in 5 s at the
    # server's close.
    await asyncio.gather(*(asyncio.to_thread(server.infer_sync, _request("patient", _rows(i))) for i in range(3)))


@pytest.mark.parametrize(("value", "hold"), [(None, DEFAULT_HOLD), ("", DEFAULT_HOLD), ("0", 0), (" 4 ", 4)])
def test_the_environment_sets_the_hold(monkeypatch: pytest.MonkeyPatch, value: str | None, hold: int) -> None:
    if value is None:
        monkeypatch.delenv(HOLD_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(HOLD_VARIABLE, value)
    assert join_hold() == hold


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_a_bad_hold_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(HOLD_VARIABLE, value)
    with pytest.raises(ConfigError, match=rf"{HOLD_VARIABLE} is '{value}'; expected a whole number"):
        join_hold()


@pytest.mark.parametrize(("value", "enabled"), [(None, True), ("1", True), ("0", False), ("off", False),
                                                (" False ", False), ("yes", True)])
def test_the_environment_turns_joining_off(monkeypatch: pytest.MonkeyPatch, value: str | None,
                                           enabled: bool) -> None:
    if value is None:
        monkeypatch.delenv(JOIN_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(JOIN_VARIABLE, value)
    assert joining_enabled() is enabled


def test_join_keys_match_only_requests_that_can_share_a_batch() -> None:
    base = join_key(_request("m", _rows(0)), None)
    assert base is not None and base == join_key(_request("m", _rows(5, 3), "other id"), None)
    binary = join_key(_request("m", _rows(0), parameters={"binary_data_output": True}), None)
    assert binary not in (None, base)  # the answer is encoded another way: they still join with their like
    final = {"triton_enable_empty_final_response": True}  # perf_analyzer's, on every gRPC request
    assert join_key(_request("m", _rows(0), parameters=final), None) == join_key(_request("m", _rows(2),
                                                                                          parameters=final), None)
    assert join_key(_request("m", _rows(0), parameters=final), None) not in (None, base)
    x = _rows(0)
    different = [
        _request("n", x), _request("m", x, model_version="2"), _request("m", np.zeros((1, 4), np.int32)),
        InferRequest("m", [InputTensor("INPUT0", DataType.INT32, x.shape, x)], outputs=[RequestedOutput("OUTPUT0")]),
    ]
    assert all(join_key(r, None) not in (None, base) for r in different)
    alone = [
        _request("m", x, parameters={"sequence_id": 3}),
        InferRequest("m", [InputTensor("INPUT0", DataType.INT32, x.shape, x, {"shared_memory_region": "r"})]),
        InferRequest("m", [InputTensor("A", DataType.INT32, (1, 3), x), InputTensor("B", DataType.INT32, (2, 3),
                                                                                  _rows(0, 2))]),
        InferRequest("m", [InputTensor("INPUT0", DataType.INT32, (), np.int32(1))]),
    ]
    assert all(join_key(r, None) is None for r in alone)
    assert join_key(_request("m", x), "key") is None


def test_a_joined_descriptor_round_trips_inline_and_in_the_arena_with_bytes_tensors() -> None:
    def request(i: int) -> InferRequest:
        words = np.array([[f"w{i}".encode(), b"xyz" * i]], dtype=object)
        return InferRequest("m", [InputTensor("S", DataType.BYTES, words.shape, words),
                                  InputTensor("X", DataType.INT32, (1, 3), _rows(i))], id=str(i))
    arena, _ = arena_pair()
    for where in (arena, None):
        joined, members = decode_joined(encode_joined([request(i) for i in range(3)], where), where, lambda _: None)
        assert members == [("0", 1, False), ("1", 1, False), ("2", 1, False)] and joined.members == 3
        assert joined.inputs[0].shape == (3, 2) and joined.inputs[1].shape == (3, 3)
        for i in range(3):
            part = slice_request(joined, i, i + 1, 1)
            assert part.inputs[0].data.tolist() == [[f"w{i}".encode(), b"xyz" * i]]
            np.testing.assert_array_equal(part.inputs[1].data, _rows(i))


def test_an_answer_splits_back_by_rows() -> None:
    data = np.arange(12, dtype=np.int32).reshape(6, 2)
    answers = split_response(InferResponse("m", "1", [OutputTensor("y", DataType.INT32, (6, 2), data)]), [1, 3, 2],
                             ["a", "b", "c"])
    assert [a.id for a in answers] == ["a", "b", "c"]
    assert [a.outputs[0].data.tolist() for a in answers] == [data[:1].tolist(), data[1:4].tolist(),
                                                               data[4:].tolist()]


def test_chunks_cut_members_at_the_row_limit() -> None:
    assert _chunks([1, 1, 1, 1, 1], 2) == [(0, 2, 0, 2), (2, 4, 2, 4), (4, 5, 4, 5)]
    assert _chunks([3, 2, 4], 5) == [(0, 2, 0, 5), (2, 3, 5, 9)]
    assert _chunks([1, 1], 0) == [(0, 1, 0, 1), (1, 2, 1, 2)]
    assert _chunks([7], 4) == [(0, 1, 0, 7)]  # too big alone: runs alone and is refused with its own error


def test_call_ids_do_not_run_out() -> None:
    """A worker counts call ids up for as long as it runs: past 2**32 (days at tens of thousands a second)."""
    header = frames.HEADER.unpack(frames.frame(2**40 + 7, frames.INFER)[:frames.HEADER.size])
    assert header == (0, 2**40 + 7, frames.INFER)


def test_a_joined_answer_is_cut_by_member_only_where_every_output_has_the_rows() -> None:
    from kiln.frontends.handoff.infer import _rows_split

    def answer(*shapes: tuple[int, ...]) -> InferResponse:
        return InferResponse("m", "1", [OutputTensor(f"O{i}", DataType.INT32, shape, np.zeros(shape, np.int32))
                                        for i, shape in enumerate(shapes)])

    assert _rows_split(answer((4, 3), (4,)), 4)
    assert not _rows_split(answer((4, 3), (1, 3)), 4)  # a per-batch output: no member's rows to cut
    assert not _rows_split(answer((4, 3), ()), 4)  # a scalar


# -- tensors in the clients' system shared memory -----------------------------------------------------------------

ROW_BYTES = 3 * 4  # one INT32 row of 3


class Regions:
    """Real POSIX shared-memory objects registered with the server as regions, unregistered and destroyed after."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.blocks: dict[str, shared_memory.SharedMemory] = {}

    def add(self, name: str, size: int) -> shared_memory.SharedMemory:
        block = shared_memory.SharedMemory(create=True, size=size)
        self.blocks[name] = block
        self.server.register_system_shared_memory(name, "/" + block.name, 0, size)
        return block

    def rows(self, name: str, rows: int, offset: int = 0) -> np.ndarray:
        return np.frombuffer(self.blocks[name].buf, np.int32, rows * 3, offset).reshape(rows, 3).copy()

    def close(self) -> None:
        for name, block in self.blocks.items():
            self.server.unregister_system_shared_memory(name)
            with contextlib.suppress(BufferError):
                block.close()
            block.unlink()


@pytest.fixture
def regions(server: Server) -> Iterator[Regions]:
    made = Regions(server)
    yield made
    made.close()


def _in_regions(model: str, rows: int, into: str, out: str, request_id: str = "", in_offset: int = 0,
                out_offset: int = 0, out_size: int | None = None) -> InferRequest:
    """A request whose input is in region ``into`` and whose output goes to region ``out``, as a codec decodes it."""
    size = rows * ROW_BYTES
    ref = SharedMemoryRef(into, size, in_offset)
    out_ref = SharedMemoryRef(out, size if out_size is None else out_size, out_offset)
    parameters = {"shared_memory_region": into, "shared_memory_byte_size": size, "shared_memory_offset": in_offset}
    out_parameters = {"shared_memory_region": out, "shared_memory_byte_size": out_ref.byte_size,
                      "shared_memory_offset": out_offset}
    return InferRequest(model, [InputTensor("INPUT0", DataType.INT32, (rows, 3), np.empty(0, np.int32), parameters,
                                            ref)], id=request_id,
                        outputs=[RequestedOutput("OUTPUT0", 0, out_parameters, out_ref)])


def _fill(regions: Regions, sizes: list[int], model: str = "batched") -> list[InferRequest]:
    """A region in and a region out for each member, the input holding the member's rows."""
    requests = []
    for i, rows in enumerate(sizes):
        block = regions.add(f"in{i}", rows * ROW_BYTES)
        regions.add(f"out{i}", rows * ROW_BYTES)
        block.buf[:rows * ROW_BYTES] = _rows(i, rows).tobytes()
        requests.append(_in_regions(model, rows, f"in{i}", f"out{i}", f"s{i}"))
    return requests


async def test_requests_in_shared_memory_join_and_each_output_goes_to_its_own_region(
        link: Link, server: Server, regions: Regions) -> None:
    before, joined_before = _success(server, "batched"), _joined(server, "batched")
    sizes = [1, 2, 1, 3, 1]
    answers = await _send(link, _fill(regions, sizes))
    assert _infer_kinds(link) == [frames.INFER, frames.INFER_JOINED]
    for i, (answer, rows) in enumerate(zip(answers, sizes, strict=True)):
        assert isinstance(answer, InferResponse), answer
        assert answer.id == f"s{i}" and answer.outputs[0].shape == (rows, 3)
        assert answer.outputs[0].shared_memory is not None and answer.outputs[0].data.size == 0
        np.testing.assert_array_equal(regions.rows(f"out{i}", rows), _rows(i, rows))
    after = _success(server, "batched")
    assert (after[0] - before[0], after[1] - before[1]) == (5, 8) and after[2] - before[2] <= 2
    assert _joined(server, "batched") == (joined_before[0] + 1, joined_before[1] + 4)
    assert await link.all_slots_back()


async def test_members_sharing_one_region_each_read_and_write_their_own_window(link: Link, server: Server,
                                                                              regions: Regions) -> None:
    """As perf_analyzer passes tensors: every request names the same input region, and outputs share one too."""
    block = regions.add("shared_in", 4 * ROW_BYTES)
    regions.add("shared_out", 4 * ROW_BYTES)
    block.buf[:4 * ROW_BYTES] = np.concatenate([_rows(i) for i in range(4)]).tobytes()
    requests = [_in_regions("batched", 1, "shared_in", "shared_out", f"w{i}", i * ROW_BYTES, i * ROW_BYTES)
                for i in range(4)]
    answers = await _send(link, requests)
    assert _infer_kinds(link) == [frames.INFER, frames.INFER_JOINED]
    assert all(isinstance(a, InferResponse) for a in answers), answers
    np.testing.assert_array_equal(regions.rows("shared_out", 4), np.concatenate([_rows(i) for i in range(4)]))


@pytest.mark.parametrize("failing", ["unknown input region", "output region too small"])
async def test_a_member_whose_region_fails_gets_its_own_error_and_the_others_their_answers(
        link: Link, server: Server, regions: Regions, failing: str) -> None:
    before = _success(server, "batched")
    requests = _fill(regions, [1, 1, 1, 1])
    if failing == "unknown input region":  # found as the joined request takes its regions, before it runs
        requests[2] = _in_regions("batched", 1, "nowhere", "out2", "s2")
        expected: tuple[type[Exception], str] = (NotFoundError, "'nowhere'")
    else:  # found only once the batch has run, as the member's rows are written
        requests[2] = _in_regions("batched", 1, "in2", "out2", "s2", out_size=ROW_BYTES - 4)
        expected = (InvalidArgumentError, "shared_memory_byte_size in region 'out2' is 8")
    answers = await _send(link, requests)
    assert _infer_kinds(link) == [frames.INFER, frames.INFER_JOINED]
    assert isinstance(answers[2], expected[0]) and expected[1] in answers[2].message, answers[2]
    for i in (0, 1, 3):
        assert isinstance(answers[i], InferResponse), answers[i]
        np.testing.assert_array_equal(regions.rows(f"out{i}", 1), _rows(i))
    # Refused before it ran, the joined request is not counted; found after, the batch ran and then each member.
    assert _success(server, "batched")[0] - before[0] == (3 if failing == "unknown input region" else 7)
    assert await link.all_slots_back()


async def test_members_in_shared_memory_over_max_batch_size_run_in_chunks(link: Link, server: Server,
                                                                          regions: Regions) -> None:
    before = _success(server, "small")
    answers = await _send(link, _fill(regions, [1] * 10, "small"))
    assert all(isinstance(a, InferResponse) for a in answers), answers
    for i in range(10):
        np.testing.assert_array_equal(regions.rows(f"out{i}", 1), _rows(i))
    after = _success(server, "small")
    assert (after[0] - before[0], after[1] - before[1]) == (10, 10) and 3 <= after[2] - before[2] <= 4


async def test_shared_memory_members_of_a_model_without_dynamic_batching_run_one_by_one(
        link: Link, server: Server, regions: Regions) -> None:
    before = _success(server, "unbatched")
    answers = await _send(link, _fill(regions, [1, 2, 1], "unbatched"))
    assert _infer_kinds(link) == [frames.INFER, frames.INFER_JOINED]
    assert all(isinstance(a, InferResponse) for a in answers), answers
    for i, rows in enumerate([1, 2, 1]):
        np.testing.assert_array_equal(regions.rows(f"out{i}", rows), _rows(i, rows))
    after = _success(server, "unbatched")
    assert (after[0] - before[0], after[2] - before[2]) == (3, 3)


async def test_requests_with_inputs_in_the_body_and_outputs_in_shared_memory_leave_one_by_one(
        link: Link, regions: Regions) -> None:
    requests = []
    for i in range(3):
        regions.add(f"out{i}", ROW_BYTES)
        request = _request("batched", _rows(i), f"b{i}")
        request.outputs = _in_regions("batched", 1, "unused", f"out{i}").outputs
        requests.append(request)
    answers = await _send(link, requests)
    assert _infer_kinds(link) == [frames.INFER] * 3
    for i, answer in enumerate(answers):
        assert isinstance(answer, InferResponse) and answer.outputs[0].shared_memory is not None, answer
        np.testing.assert_array_equal(regions.rows(f"out{i}", 1), _rows(i))


async def test_a_fault_while_answering_a_joined_request_fails_each_member_instead_of_leaving_it_waiting(
        link: Link, server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(_: InferRequest) -> int:
        raise RuntimeError("a fault in the server process")

    monkeypatch.setattr(server, "joined_rows", broken)
    answers = await asyncio.wait_for(_send(link, [_request("batched", _rows(i)) for i in range(4)]), 10)
    assert _infer_kinds(link) == [frames.INFER, frames.INFER_JOINED]
    assert isinstance(answers[0], InferResponse)  # alone: not joined
    for answer in answers[1:]:
        assert isinstance(answer, InternalError) and "a fault in the server process" in answer.message, answer


def test_join_keys_of_requests_in_shared_memory() -> None:
    one, other = _in_regions("m", 1, "a", "b"), _in_regions("m", 2, "c", "d", in_offset=64)
    assert join_key(one, None) is not None and join_key(one, None) == join_key(other, None)  # regions may differ
    assert join_key(one, None) != join_key(_request("m", _rows(0)), None)  # not with a request body
    body_out = _in_regions("m", 1, "a", "b")
    body_out.outputs = [RequestedOutput("OUTPUT0")]
    assert join_key(body_out, None) not in (None, join_key(one, None))  # an output in the body is another batch
    mixed = _in_regions("m", 1, "a", "b")
    mixed.inputs.append(InputTensor("INPUT1", DataType.INT32, (1, 3), _rows(0)))
    assert join_key(mixed, None) is None  # some inputs in shared memory and others not
    body_in = _request("m", _rows(0))
    body_in.outputs = one.outputs
    assert join_key(body_in, None) is None  # an output in shared memory for inputs in the request


def test_a_joined_descriptor_names_each_members_regions() -> None:
    requests = [_in_regions("m", rows, f"in{i}", f"out{i}", str(i), in_offset=8 * i) for i, rows in
                enumerate([1, 3])]
    requests[0].outputs[0].parameters["binary_data"] = False  # kept: it says how the member's answer is encoded
    joined, members = decode_joined(encode_joined(requests, None, [False, True]), None, lambda _: None)
    assert members == [("0", 1, False), ("1", 3, True)] and joined.member_rows == (1, 3) and joined.held == 1
    assert joined.inputs[0].shape == (4, 3) and joined.inputs[0].shared_memory is None
    assert joined.inputs[0].member_regions == (SharedMemoryRef("in0", 12, 0), SharedMemoryRef("in1", 36, 8))
    assert joined.outputs[0].member_regions == (SharedMemoryRef("out0", 12), SharedMemoryRef("out1", 36))
    assert joined.outputs[0].parameters == {"binary_data": False} and joined.outputs[0].shared_memory is None
    second = slice_request(joined, 1, 4, 1, "1", 1)  # one member's slice is the request its client sent
    assert second.member_rows == () and second.inputs[0].shared_memory == SharedMemoryRef("in1", 36, 8)
    assert second.inputs[0].parameters == {"shared_memory_region": "in1", "shared_memory_byte_size": 36,
                                           "shared_memory_offset": 8}
    assert second.outputs[0].shared_memory == SharedMemoryRef("out1", 36)
