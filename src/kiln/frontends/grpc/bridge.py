"""The link between gRPC worker processes and the server process: framing, and the server's side of it.

With ``kiln serve --grpc-workers N`` the gRPC frontend runs in N worker processes that share the port, because one
Python process spends most of its core in grpc.aio's per-call work (benchmarks/README.md, framework ceilings).
ModelInfer is decoded in the worker and handed over as the HTTP workers hand theirs (frontends/handoff): input
tensors in the worker's shared-memory arena, a descriptor on the link, outputs answered in the server process's
arena. Every other call's serialized request is forwarded to the server process, where the same
:class:`~kiln.frontends.grpc.servicer.GRPCInferenceService` handles it, and the serialized answer comes back. So
scheduling, statistics, shared-memory registries and model control stay in one place.

Each frame is a header (payload size, call id, kind, method index) and a payload. A forwarded unary call is one
CALL and one REPLY or END; a stream is OPEN, MESSAGE..., HALF_CLOSE one way and REPLY..., END the other. END
carries the gRPC status code (0 for a stream that finished well) and the details. ModelInfer is INFER (a request
descriptor) and ANSWER (an answer descriptor) or END; several ModelInfer requests joined into one (kiln.v2.joined)
are INFER_JOINED, answered by JOINED_ANSWER for a run of its members or ANSWER/END for each
(frontends/handoff/calls.py); RELEASE (call 0, either way) lists arena slots the receiver may reuse.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health_pb2  # type: ignore[import-untyped]  # no type info

from kiln.errors import KilnError
from kiln.frontends.grpc.servicer import RAW_REQUEST_METHODS, GRPCInferenceService, model_infer_error
from kiln.frontends.handoff.arena import Arena
from kiln.frontends.handoff.frames import FrameProtocol, Releases
from kiln.frontends.handoff.infer import InferHandoff
from kiln.server.server import Server
from kiln.v2 import status
from kiln.v2._generated import grpc_service_pb2 as pb

log = logging.getLogger("kiln.grpc.bridge")

HEADER = struct.Struct("<IQBB")  # payload bytes, call id (64-bit, as frames.py), kind, method index
CALL, OPEN, MESSAGE, HALF_CLOSE, CANCEL, REPLY, END, HELLO, INFER, ANSWER, RELEASE, INFER_JOINED, JOINED_ANSWER = \
    range(13)

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
HEALTH_SERVICE = "grpc.health.v1.Health"


@dataclass(frozen=True)
class Method:
    service: str
    name: str
    streaming: bool  # a stream of requests and of responses (ModelStreamInfer); all others are unary
    request_type: Any
    raw: bool = False  # the servicer takes the request as bytes (RAW_REQUEST_METHODS)


# Both sides index this list; Health.Watch is served by the workers from Check (see worker.py).
METHODS: tuple[Method, ...] = (
    *(Method(SERVICE.full_name, m.name, m.client_streaming, getattr(pb, m.input_type.name),
             m.name in RAW_REQUEST_METHODS) for m in SERVICE.methods),
    Method(HEALTH_SERVICE, "Check", False, health_pb2.HealthCheckRequest),
)
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def method_index(service: str, name: str) -> int:
    return next(i for i, m in enumerate(METHODS) if m.service == service and m.name == name)


def frame(call: int, kind: int, payload: bytes = b"", method: int = 0) -> bytes:
    return HEADER.pack(len(payload), call, kind, method) + payload


def end_payload(code: grpc.StatusCode, details: str) -> bytes:
    return bytes([code.value[0]]) + details.encode()


def frame_protocol(on_frame: Callable[[int, int, int, bytes], None]) -> FrameProtocol:
    """A connection's framing, with the method index in each header."""
    return FrameProtocol(on_frame, HEADER)


def releases(protocol: FrameProtocol) -> Releases:
    """Arena slots to hand back over ``protocol``, in this link's RELEASE frames."""
    return Releases(protocol, lambda payload: frame(0, RELEASE, payload))


def _reply(call: int, answer: bytes | KilnError) -> bytes:
    if isinstance(answer, bytes):
        return frame(call, ANSWER, answer)
    return frame(call, END, end_payload(status.grpc_code(answer), answer.message))


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _Context:
    """The part of ``grpc.aio.ServicerContext`` that kiln's servicers use."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise _Aborted(code, details)


Handler = Callable[[Any, Any], Any]


class BridgeCore:
    """The server process's end: answers the workers' calls with the in-process servicers."""

    def __init__(self, server: Server, servicer: GRPCInferenceService, health: Any,
                 on_hello: Callable[[], None]) -> None:
        self._server = server
        self._handlers: list[Handler] = [
            getattr(servicer if m.service == SERVICE.full_name else health, m.name) for m in METHODS]
        self._on_hello = on_hello
        self._context = _Context()  # stateless: one serves every call

    def connection(self, request_arena: Arena | None, response_arena: Arena | None) -> FrameProtocol:
        """A protocol for one worker's connection, with the worker's arena (its ModelInfer inputs) and this
        side's (the outputs); None where the platform gave none, and tensors then travel inline."""
        tasks: dict[int, asyncio.Task[None]] = {}
        streams: dict[int, asyncio.Queue[bytes | None]] = {}

        def on_frame(call: int, kind: int, method: int, payload: bytes) -> None:
            if kind == INFER:
                self._track(tasks, call, self._infer(protocol, slots, handoff, call, payload))
            elif kind == INFER_JOINED:
                self._track(tasks, call, self._infer_joined(protocol, slots, handoff, call, payload))
            elif kind == CALL:
                self._track(tasks, call, self._unary(protocol, call, method, payload))
            elif kind == OPEN:
                queue = streams[call] = asyncio.Queue()
                self._track(tasks, call, self._stream(protocol, call, method, queue, streams))
            elif kind == MESSAGE and call in streams:
                streams[call].put_nowait(payload)
            elif kind == HALF_CLOSE and call in streams:
                streams[call].put_nowait(None)
            elif kind == CANCEL and call in tasks:
                tasks[call].cancel()
            elif kind == RELEASE:
                handoff.free(payload)
            elif kind == HELLO:
                self._on_hello()

        def lost(_: object) -> None:
            """The worker went away: its calls' answers have nowhere to go."""
            for task in list(tasks.values()):
                task.cancel()
            handoff.close()

        protocol = frame_protocol(on_frame)
        slots = releases(protocol)
        handoff = InferHandoff(self._server, request_arena, response_arena, slots.add, translate=model_infer_error)
        protocol.closed.add_done_callback(lost)
        return protocol

    @staticmethod
    async def _infer(protocol: FrameProtocol, slots: Releases, handoff: InferHandoff, call: int,
                     payload: bytes) -> None:
        answer = await handoff.answer(payload)
        # The inputs' slot is released by now unless a mirrored request still reads it; the release rides along.
        protocol.send(slots.take() + _reply(call, answer))

    @staticmethod
    async def _infer_joined(protocol: FrameProtocol, slots: Releases, handoff: InferHandoff, call: int,
                            payload: bytes) -> None:
        answers = await handoff.answer_joined(payload)
        replies = [frame(call + index, JOINED_ANSWER, answer) if isinstance(answer, bytes) and members > 1
                   else _reply(call + index, answer)
                   for index, answer, members in answers]
        protocol.send(slots.take() + b"".join(replies))

    @staticmethod
    def _track(tasks: dict[int, asyncio.Task[None]], call: int, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        tasks[call] = task
        task.add_done_callback(lambda _: tasks.pop(call, None))

    async def _unary(self, protocol: FrameProtocol, call: int, method: int, payload: bytes) -> None:
        try:
            request = payload if METHODS[method].raw else METHODS[method].request_type.FromString(payload)
        except Exception as exc:  # protobuf's DecodeError: bytes that are no such message
            protocol.send(frame(call, END, end_payload(grpc.StatusCode.INVALID_ARGUMENT,
                                                       f"could not parse the {METHODS[method].name} request: {exc}")))
            return
        try:
            response = await self._handlers[method](request, self._context)
            protocol.send(frame(call, REPLY, response.SerializeToString()))
        except _Aborted as exc:  # how kiln's servicers report every error (the rpc wrapper)
            protocol.send(frame(call, END, end_payload(exc.code, exc.details)))
        except Exception as exc:  # a handler outside that wrapper failed
            log.exception("gRPC %s failed", METHODS[method].name)
            protocol.send(frame(call, END, end_payload(grpc.StatusCode.INTERNAL, f"internal error: {exc}")))

    async def _stream(self, protocol: FrameProtocol, call: int, method: int,
                      queue: asyncio.Queue[bytes | None], streams: dict[int, Any]) -> None:
        parse = (lambda item: item) if METHODS[method].raw else METHODS[method].request_type.FromString

        async def requests() -> AsyncIterator[Any]:
            while (item := await queue.get()) is not None:
                yield parse(item)

        try:
            async for response in self._handlers[method](requests(), self._context):
                protocol.send(frame(call, REPLY, response.SerializeToString()))
            protocol.send(frame(call, END, end_payload(grpc.StatusCode.OK, "")))
        except _Aborted as exc:
            protocol.send(frame(call, END, end_payload(exc.code, exc.details)))
        finally:
            streams.pop(call, None)
