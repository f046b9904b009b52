"""What an HTTP worker process serves: infer requests decoded here and handed to the server process as
descriptors, every other request forwarded whole (core.py is the other end).

The infer path reads and decodes the body with the in-process frontend's own functions (size limit, gzip, JSON
and binary tensors) and encodes the answer with them too, so bodies, status codes and error messages are the
same bytes. A raw single-input body (``Inference-Header-Content-Length: 0``) needs the model's metadata, which
lives in the server process: it is forwarded, already read. Most infer requests never reach this app: the
worker's infer lane (infer_lane.py) answers them from the connection's callbacks with the same functions.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from kiln.errors import ErrorCode, InvalidArgumentError, UnavailableError, error_for_code
from kiln.frontends.access import AccessPolicy, policy_from_environment
from kiln.frontends.handoff import frames
from kiln.frontends.handoff.arena import Arena
from kiln.frontends.handoff.calls import DEFAULT_HOLD, HOLD_FROM, LOST, MAX_HOLD_S, Answer, InferCalls, Refused
from kiln.frontends.handoff.frames import FrameProtocol, Releases, frame
from kiln.frontends.http.app import _infer_params
from kiln.frontends.http.auth import restricted
from kiln.frontends.http.core import forward_payload
from kiln.frontends.http.endpoints import render
from kiln.frontends.http.routing import ROUTING_KEY_HEADER
from kiln.v2 import http_codec as codec
from kiln.v2.http_body import read_body
from kiln.v2.http_responses import error_response
from kiln.v2.types import InferRequest

GONE = "the server process is not answering (it is shutting down or has stopped)"
_DROPPED_WHEN_DECODED = (b"content-encoding", b"content-length")


class CoreClient:
    """The worker's end of the link: requests out, answers matched to them by call id (infer calls: calls.py;
    ``join`` False sends each infer request on its own; ``hold``, ``max_hold_s`` and ``hold_from`` as InferCalls
    takes them)."""

    def __init__(self, request_arena: Arena | None, response_arena: Arena | None, join: bool = True,
                 hold: int = DEFAULT_HOLD, max_hold_s: float = MAX_HOLD_S, hold_from: int = HOLD_FROM) -> None:
        self._request_arena = request_arena
        self._ids = itertools.count(1)
        self._streams: dict[int, asyncio.Queue[tuple[int, bytes]]] = {}
        self.protocol = FrameProtocol(self._on_frame)
        self._releases = Releases(self.protocol)
        self._calls = InferCalls(self.protocol, self._releases, self._ids, request_arena, response_arena,
                                 infer_frame=lambda call, payload: frame(call, frames.INFER, payload),
                                 joined_frame=lambda call, payload: frame(call, frames.INFER_JOINED, payload),
                                 answer_kind=frames.ANSWER, joined_kind=frames.JOINED_ANSWER, join=join,
                                 hold=hold, max_hold_s=max_hold_s, hold_from=hold_from)
        self.protocol.closed.add_done_callback(self._lost)

    def _on_frame(self, call: int, kind: int, payload: bytes) -> None:
        if kind == frames.RELEASE:
            if self._request_arena is not None:
                for offset in frames.unpack_offsets(payload):
                    self._request_arena.free(offset)
        elif call in self._streams:
            self._streams[call].put_nowait((kind, payload))
        else:
            self._calls.on_frame(call, kind, payload)

    def _lost(self, _: object) -> None:
        for stream in self._streams.values():
            stream.put_nowait((LOST, b""))

    def send(self, call: int, kind: int, payload: bytes = b"") -> None:
        self.protocol.send(frame(call, kind, payload))

    async def infer(self, request: InferRequest, routing_key: str | None) -> Answer:
        """The Server's answer and what to call once its outputs are encoded (it lets their arena slot go);
        raises the Server's error as the typed error."""
        try:
            return await self._calls.infer(request, routing_key)
        except Refused as refused:
            raise self.typed(refused) from None

    def submit(self, request: InferRequest, routing_key: str | None) -> asyncio.Future[Answer]:
        """:meth:`infer` without waiting: read the future with :meth:`result`. Raises
        :class:`~kiln.frontends.handoff.calls.Refused` when the link is gone already (:meth:`typed` words it)."""
        return self._calls.submit(request, routing_key)

    def result(self, future: asyncio.Future[Answer]) -> Answer:
        """A submitted request's answer; raises the Server's error as the typed error."""
        try:
            return future.result()
        except Refused as refused:
            raise self.typed(refused) from None

    @staticmethod
    def typed(exc: Exception) -> Exception:
        """The error a client is to see for a refusal of the link (others are returned as they are)."""
        if not isinstance(exc, Refused):
            return exc
        if exc.kind == frames.ERROR:
            code, message = orjson.loads(exc.payload)
            return error_for_code(ErrorCode(code), message)
        return UnavailableError(GONE)

    def open(self, payload: bytes) -> tuple[int, asyncio.Queue[tuple[int, bytes]]]:
        call = next(self._ids)
        queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
        self._streams[call] = queue
        if self.protocol.closed.done():
            queue.put_nowait((LOST, b""))
        else:
            self.send(call, frames.FORWARD, payload)
        return call, queue

    def forget(self, call: int) -> None:
        self._streams.pop(call, None)


class WorkerApp:
    """The worker's ASGI app; ``max_input_size`` is the server's --http-max-input-size. ``access``: the restricted
    API groups (default: the policy the server process put in this process's environment), checked here since
    infer requests never reach the server process's app."""

    def __init__(self, core: CoreClient, max_input_size: int, access: AccessPolicy | None = None) -> None:
        self.core = core
        self.max_input_size = max_input_size
        self.access = access if access is not None else policy_from_environment()
        self._entry = restricted(self._serve, self.access)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._entry(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; websockets are no route of the protocol
        params = _infer_params(scope) if scope["method"] == "POST" else None
        # A body over the limit goes as it is: the server process says first whether the model exists.
        if params is None or self._over_limit(scope):
            await self._forward(scope, receive, send, await self._read_raw(scope, receive), decoded=False)
            return
        request = Request(scope, receive)
        try:
            body = await read_body(request, self.max_input_size)
            json_size = codec.header_length(request.headers.get(codec.HEADER_LENGTH), len(body))
            if json_size == 0:  # raw body: decoding needs the model's metadata, which the server process has
                await self._forward(scope, receive, send, body, decoded=True)
                return
            try:
                infer_request = codec.decode_request(params["model"], params.get("version", ""), body, json_size)
            except InvalidArgumentError:  # the server process knows whether the model exists, and says first
                await self._forward(scope, receive, send, body, decoded=True)
                return
            response = await self._infer(infer_request, request.headers.get(ROUTING_KEY_HEADER))
        except Exception as exc:  # as the in-process endpoint's guard (app.py) answers it
            response = error_response(exc)
        await response(scope, receive, send)

    async def _infer(self, request: InferRequest, routing_key: str | None) -> Response:
        """As Endpoints.infer from the Server call on."""
        answer, release = await self.core.infer(request, routing_key)
        try:
            return render(answer, request)
        finally:
            release()  # the body holds a copy of every output now

    def _over_limit(self, scope: Scope) -> bool:
        declared = dict(scope["headers"]).get(b"content-length", b"")
        return declared.isdigit() and int(declared) > self.max_input_size

    async def _read_raw(self, scope: Scope, receive: Receive) -> bytes:
        """The body as received, cut after the limit: the server process's route applies the limit itself (its
        message then reads as in one process) and must not wait for a body it will refuse."""
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_input_size:
            return b""
        chunks: list[bytes] = []
        total = 0
        more = True
        while more and total <= self.max_input_size:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk: bytes = message.get("body", b"")
            chunks.append(chunk)
            total += len(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)

    async def _forward(self, scope: Scope, receive: Receive, send: Send, body: bytes, *, decoded: bool) -> None:
        """Have the server process answer the request; ``decoded``: ``body`` is already decompressed."""
        headers = [(k, v) for k, v in scope["headers"] if not (decoded and k in _DROPPED_WHEN_DECODED)]
        if decoded:
            headers.append((b"content-length", str(len(body)).encode()))
        call, answers = self.core.open(forward_payload(_describe(scope, headers), body))
        watcher = asyncio.create_task(self._watch_disconnect(receive, call))
        try:
            await self._relay(answers, call, send)
        finally:
            watcher.cancel()
            self.core.forget(call)

    async def _relay(self, answers: asyncio.Queue[tuple[int, bytes]], call: int, send: Send) -> None:
        started = False
        while True:
            kind, payload = await answers.get()
            if kind == frames.START:
                started = True
                head = orjson.loads(payload)
                await send({"type": "http.response.start", "status": head["status"],
                            "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in head["headers"]]})
            elif kind == frames.BODY and started:
                await send({"type": "http.response.body", "body": payload, "more_body": True})
                self.core.send(call, frames.ACK)
            elif kind in (frames.BODY_END, LOST) and started:
                await send({"type": "http.response.body", "body": payload, "more_body": False})
                return
            else:  # the server process went away (or answered nothing) before the response started
                await _send(error_response(UnavailableError(GONE)), send)
                return

    async def _watch_disconnect(self, receive: Receive, call: int) -> None:
        """Tell the server process when the client goes away (a streamed download then stops there)."""
        while (await receive())["type"] != "http.disconnect":
            pass
        self.core.send(call, frames.DISCONNECT)


def _describe(scope: Scope, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    """The parts of a scope the server process's app reads, as JSON (core._scope rebuilds it)."""
    return {
        "http_version": scope.get("http_version", "1.1"),
        "method": scope["method"],
        "scheme": scope.get("scheme", "http"),
        "path": scope["path"],
        "raw_path": (scope.get("raw_path") or scope["path"].encode()).decode("latin-1"),
        "query_string": scope.get("query_string", b"").decode("latin-1"),
        "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in headers],
        "client": list(scope["client"]) if scope.get("client") else None,
        "server": list(scope["server"]) if scope.get("server") else None,
    }


async def _send(response: Response, send: Send) -> None:
    async def nothing() -> Message:
        return {"type": "http.disconnect"}

    await response({"type": "http"}, nothing, send)
