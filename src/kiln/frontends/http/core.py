"""The server process's end of an HTTP worker's link: infer descriptors run on the Server, every other request
runs through the same ASGI app the in-process frontend serves.

An infer request arrives decoded and is answered by the handoff the gRPC workers' link shares (handoff/infer.py):
its inputs become numpy views on the worker's arena, the Server answers, and the outputs go into this side's arena
for the worker to encode. Anything else arrives whole (method, path, query, headers, body) and is answered by
calling the app with a synthesized scope, so each route has one implementation and its checks (API keys, body
limits, errors) hold as they do in one process. A forwarded response is streamed back chunk by chunk, at most
``WINDOW`` chunks ahead of what the worker has delivered.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from starlette.types import ASGIApp, Message

from kiln.errors import KilnError
from kiln.frontends.handoff import frames
from kiln.frontends.handoff.arena import Arena
from kiln.frontends.handoff.frames import FrameProtocol, Releases, frame
from kiln.frontends.handoff.infer import InferHandoff, error_payload
from kiln.frontends.http.routing import apply_routing_key
from kiln.server.server import Server
from kiln.v2.http_responses import error_response
from kiln.v2.types import InferRequest

log = logging.getLogger("kiln.http.workers")

WINDOW = 8  # streamed chunks in flight per forwarded response
_LENGTH = struct.Struct("<I")


def forward_payload(request: dict[str, Any], body: bytes) -> bytes:
    """A FORWARD frame's payload: the request's scope document, then its body."""
    encoded = orjson.dumps(request)
    return _LENGTH.pack(len(encoded)) + encoded + body


def split_forward(payload: bytes) -> tuple[dict[str, Any], bytes]:
    (length,) = _LENGTH.unpack_from(payload)
    return orjson.loads(payload[_LENGTH.size:_LENGTH.size + length]), payload[_LENGTH.size + length:]


class _Forwarded:
    """What the worker may still say about one forwarded request: chunks delivered, client gone."""

    def __init__(self) -> None:
        self.credits = asyncio.Semaphore(WINDOW)
        self.disconnected = asyncio.Event()


class CoreLink:
    """One worker's link. ``arenas``: the worker's (its requests' inputs) and this side's (answers' outputs);
    None where the platform gave none, and tensors then travel inline."""

    def __init__(self, server: Server, app: ASGIApp, request_arena: Arena | None, response_arena: Arena | None,
                 on_hello: Callable[[], None]) -> None:
        self._server = server
        self._app = app
        self._on_hello = on_hello
        self._tasks: set[asyncio.Task[None]] = set()
        self._forwarded: dict[int, _Forwarded] = {}
        self.protocol = FrameProtocol(self._on_frame)
        self._releases = Releases(self.protocol)
        self._handoff = InferHandoff(server, request_arena, response_arena, self._releases.add, route=self._route)
        self.protocol.closed.add_done_callback(self._lost)

    def _on_frame(self, call: int, kind: int, payload: bytes) -> None:
        if kind == frames.INFER:
            self._track(self._infer(call, payload))
        elif kind == frames.INFER_JOINED:
            self._track(self._infer_joined(call, payload))
        elif kind == frames.FORWARD:
            self._forwarded[call] = _Forwarded()
            self._track(self._forward(call, payload))
        elif kind == frames.ACK and call in self._forwarded:
            self._forwarded[call].credits.release()
        elif kind == frames.DISCONNECT and call in self._forwarded:
            self._forwarded[call].disconnected.set()
        elif kind == frames.RELEASE:
            self._handoff.free(payload)
        elif kind == frames.HELLO:
            self._on_hello()

    def _track(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _lost(self, _: object) -> None:
        """The worker is gone: its requests' answers have nowhere to go."""
        for task in list(self._tasks):
            task.cancel()
        self._handoff.close()

    async def _infer(self, call: int, payload: bytes) -> None:
        answer = await self._handoff.answer(payload)
        # The request is gone by now: its inputs' slot is released already, unless a mirrored request still reads
        # them, and the release leaves with the answer.
        self.protocol.send(self._releases.take() + _reply(call, answer))

    async def _infer_joined(self, call: int, payload: bytes) -> None:
        answers = await self._handoff.answer_joined(payload)

        replies = [frame(call + index, frames.JOINED_ANSWER, answer) if isinstance(answer, bytes) and members > 1
                   else _reply(call + index, answer)
                   for index, answer, members in answers]
        self.protocol.send(self._releases.take() + b"".join(replies))

    def _route(self, request: InferRequest, routing_key: str) -> None:
        apply_routing_key(self._server, routing_key, request)

    async def _forward(self, call: int, payload: bytes) -> None:
        state = self._forwarded[call]
        request, body = split_forward(payload)
        scope = _scope(request)
        pending = [body]
        started = ended = False

        async def receive() -> Message:
            if pending:
                return {"type": "http.request", "body": pending.pop(), "more_body": False}
            await state.disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal started, ended
            if message["type"] == "http.response.start":
                started = True
                headers = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in message.get("headers", [])]
                self.protocol.send(frame(call, frames.START, orjson.dumps(
                    {"status": message["status"], "headers": headers})))
            elif message["type"] == "http.response.body" and not ended:
                if message.get("more_body", False):
                    await state.credits.acquire()
                    self.protocol.send(frame(call, frames.BODY, bytes(message.get("body", b""))))
                else:
                    ended = True
                    self.protocol.send(frame(call, frames.BODY_END, bytes(message.get("body", b""))))

        try:
            await self._app(scope, receive, send)
        except Exception as exc:  # the app answers its own errors; this is a failure past its handlers
            log.exception("HTTP %s %s failed", scope["method"], scope["path"])
            if not started:
                await error_response(exc)(scope, receive, send)
        finally:
            self._forwarded.pop(call, None)
        if not ended:  # an app that sent no (complete) answer: end what the worker has
            self.protocol.send(frame(call, frames.BODY_END))


def _reply(call: int, answer: bytes | KilnError) -> bytes:
    if isinstance(answer, bytes):
        return frame(call, frames.ANSWER, answer)
    return frame(call, frames.ERROR, error_payload(answer))


def _scope(request: dict[str, Any]) -> dict[str, Any]:
    """An ASGI HTTP scope from a worker's description of the request it received."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": request["http_version"],
        "method": request["method"],
        "scheme": request["scheme"],
        "path": request["path"],
        "raw_path": request["raw_path"].encode("latin-1"),
        "query_string": request["query_string"].encode("latin-1"),
        "root_path": "",
        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request["headers"]],
        "client": tuple(request["client"]) if request["client"] else None,
        "server": tuple(request["server"]) if request["server"] else None,
        "state": {},
        "extensions": {},
    }
