"""The server process's side of a decoded infer request (one handler for HTTP's and gRPC's workers): a real Server
answers views on the worker's arena, the outputs land in this side's arena, the input slot comes back once the
request is gone, and failures come back as typed errors (translated as the frontend reports them)."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kiln.engines import host_memory
from kiln.errors import ErrorCode, NotFoundError, UnsupportedError
from kiln.frontends.handoff.frames import pack_offsets
from kiln.frontends.handoff.infer import InferHandoff, error_from_payload, error_payload
from kiln.frontends.handoff.tensors import decode_response, encode_request
from kiln.server.server import Server, ServerOptions
from kiln.tensor import DataType
from kiln.v2.types import InferRequest, InputTensor

from .._arenas import arena_pair

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="arenas need memfd_create (Linux)")

ECHO = """name: "echo"
backend: "identity"
max_batch_size: 4
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ -1 ] } ]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("repo")
    (root / "echo" / "1").mkdir(parents=True)
    (root / "echo" / "config.pbtxt").write_text(ECHO)
    kiln_server = Server(ServerOptions(repositories=[Path(root)]))
    kiln_server.start()
    yield kiln_server
    kiln_server.close()


def _request(model: str, data: np.ndarray) -> InferRequest:
    return InferRequest(model_name=model, inputs=[InputTensor("INPUT0", DataType.INT32, data.shape, data)])


async def test_the_answer_lies_in_the_response_arena_and_the_input_slot_comes_back(server: Server) -> None:
    worker_requests, server_requests = arena_pair()
    server_responses, worker_responses = arena_pair()
    released: list[int] = []
    handoff = InferHandoff(server, server_requests, server_responses, released.append)
    data = np.arange(6, dtype=np.int32).reshape(2, 3)
    answer = await handoff.answer(encode_request(_request("echo", data), worker_requests))
    assert isinstance(answer, bytes)
    await asyncio.sleep(0)  # the finished engine call's future (and the identity's output view) go with this turn
    gc.collect()
    assert released == [0]  # the inputs' slot, once the request's views are gone
    response, slot = decode_response(answer, worker_responses)
    assert slot is not None and server_responses.used_bytes > 0
    np.testing.assert_array_equal(response.outputs[0].data, data)
    del response
    handoff.free(pack_offsets([slot]))
    assert server_responses.used_bytes == 0


async def test_failures_come_back_as_typed_errors(server: Server) -> None:
    handoff = InferHandoff(server, None, None, lambda _: None)
    error = await handoff.answer(encode_request(_request("no_such_model", np.zeros((1, 2), np.int32)), None))
    assert isinstance(error, NotFoundError) and "no_such_model" in error.message
    again = error_from_payload(error_payload(error))
    assert (again.code, again.message) == (ErrorCode.NOT_FOUND, error.message)


async def test_the_frontend_words_an_error_its_own_way(server: Server) -> None:
    def translate(exc: Exception) -> Exception:
        return UnsupportedError("not here") if isinstance(exc, NotFoundError) else exc

    handoff = InferHandoff(server, None, None, lambda _: None, translate=translate)
    error = await handoff.answer(encode_request(_request("no_such_model", np.zeros((1, 2), np.int32)), None))
    assert isinstance(error, UnsupportedError) and error.message == "not here"


def test_the_request_arena_is_listed_for_engines_while_the_worker_lives(server: Server) -> None:
    """A GPU engine copies inputs to the device from where the worker wrote them (kiln.engines.host_memory): the
    arena is listed from the start and off the list once the worker is gone, before it is unmapped."""
    worker_requests, server_requests = arena_pair()
    server_responses, _ = arena_pair()
    handoff = InferHandoff(server, server_requests, server_responses, lambda _: None)
    inside = np.frombuffer(server_requests.buffer, dtype=np.uint8, count=64, offset=128)
    address = int(inside.__array_interface__["data"][0])
    del inside
    listed = host_memory.containing(address, 64)
    assert listed is not None and listed.size == server_requests.size
    handoff.close()
    assert host_memory.containing(address, 64) is None
    worker_requests.close()
