"""The HTTP worker's end of the link to the server process, over a real socket pair: an answer whose request was
cancelled (its client went away) still hands the arena slot its outputs lie in back to the server process."""

from __future__ import annotations

import asyncio
import os
import socket

import numpy as np
import pytest

from kiln.frontends.handoff import frames
from kiln.frontends.handoff.arena import Arena, create_arena_file
from kiln.frontends.handoff.frames import FrameProtocol, frame, unpack_offsets
from kiln.frontends.handoff.tensors import encode_response, response_slot
from kiln.frontends.http.worker_app import CoreClient
from kiln.tensor import DataType
from kiln.v2.types import InferRequest, InferResponse, InputTensor, OutputTensor

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="arenas need memfd_create (Linux)")


async def test_an_answer_for_a_cancelled_request_gives_its_output_slot_back() -> None:
    fd = create_arena_file(1 << 16)
    assert fd is not None
    server_side, worker_side = Arena.from_fd(fd), Arena.from_fd(fd)
    os.close(fd)
    loop = asyncio.get_running_loop()
    received: list[tuple[int, int, bytes]] = []
    core = FrameProtocol(lambda call, kind, payload: received.append((call, kind, payload)))
    client = CoreClient(None, worker_side)
    ours, theirs = socket.socketpair()
    await loop.create_connection(lambda: client.protocol, sock=ours)
    await loop.create_connection(lambda: core, sock=theirs)

    x = np.zeros((1, 2), np.float32)
    waiting = asyncio.create_task(client.infer(InferRequest("m", [InputTensor("x", DataType.FP32, x.shape, x)]),
                                               None))
    while not received:
        await asyncio.sleep(0.001)
    ((call, kind, _),) = received
    assert kind == frames.INFER
    waiting.cancel()  # the client went away before the answer came
    answer = encode_response(InferResponse("m", "1", [OutputTensor("y", DataType.FP32, x.shape, x)]), server_side)
    slot = response_slot(answer)
    assert slot is not None and server_side.used_bytes > 0
    core.send(frame(call, frames.ANSWER, answer))
    for _ in range(500):
        releases = [unpack_offsets(p) for _, k, p in received if k == frames.RELEASE]
        if releases:
            break
        await asyncio.sleep(0.002)
    assert releases == [(slot,)]
    with pytest.raises(asyncio.CancelledError):
        await waiting
    client.protocol.transport.close()  # type: ignore[union-attr]
    core.transport.close()  # type: ignore[union-attr]
