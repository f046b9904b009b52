"""One gRPC worker process: a grpc.aio server on the shared port, answering calls through the server process.

Started by :mod:`kiln.frontends.grpc.workers` as ``python -m kiln.frontends.grpc.worker --link-fd FD
--address HOST:PORT`` with the descriptors it inherits: the link to the server process (one end of a socket pair)
and the two arenas. ModelInfer is parsed and decoded here with the in-process servicer's codec, its input tensors
written into the request arena, and its answer encoded here from views on the response arena; every other call
passes through as bytes. SIGTERM stops accepting calls and lets those in flight finish for ``--grace`` seconds;
losing the link ends the process, since no call could be answered any more.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health_pb2  # type: ignore[import-untyped]  # no type info

from kiln.errors import InvalidArgumentError
from kiln.frontends.access import policy_from_environment
from kiln.frontends.grpc.access import interceptors, listen, tls_from_args
from kiln.frontends.grpc.bridge import (
    ANSWER,
    CALL,
    CANCEL,
    END,
    HALF_CLOSE,
    HEALTH_SERVICE,
    HELLO,
    INFER,
    INFER_JOINED,
    JOINED_ANSWER,
    MESSAGE,
    METHODS,
    OPEN,
    RELEASE,
    REPLY,
    SERVICE,
    STATUS_CODES,
    frame,
    frame_protocol,
    method_index,
    releases,
)
from kiln.frontends.grpc.server import GrpcConnectionLimits
from kiln.frontends.handoff.arena import Arena, inherited_arena
from kiln.frontends.handoff.calls import DEFAULT_HOLD, Answer, InferCalls, Refused, join_hold, joining_enabled
from kiln.frontends.handoff.frames import unpack_offsets
from kiln.heap import keep_freed_heap
from kiln.v2 import grpc_codec as codec
from kiln.v2._generated import grpc_service_pb2 as pb
from kiln.v2.types import InferRequest

HEALTH_POLL_S = 1.0  # how often an open health Watch asks the server process again
GONE = "the server process is not answering (it is shutting down or has stopped)"
MODEL_INFER = method_index(SERVICE.full_name, "ModelInfer")
MODEL_METADATA = method_index(SERVICE.full_name, "ModelMetadata")


class CallFailed(Exception):
    """The server process answered a call with a gRPC status (or cannot answer: UNAVAILABLE)."""

    def __init__(self, code: int, details: bytes) -> None:
        super().__init__(details.decode(errors="replace"))
        self.code = code
        self.details = details


class BridgeClient:
    """The worker's end of the bridge: one Unix connection, calls matched to answers by call id. ``arenas``: this
    side's (ModelInfer inputs) and the server process's (outputs); None where the platform gave none."""

    def __init__(self, request_arena: Arena | None = None, response_arena: Arena | None = None,
                 join: bool = True, hold: int = DEFAULT_HOLD) -> None:
        self._request_arena = request_arena
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self._streams: dict[int, asyncio.Queue[tuple[int, bytes]]] = {}
        self.protocol = frame_protocol(self._on_frame)
        self._releases = releases(self.protocol)
        self._calls = InferCalls(self.protocol, self._releases, self._ids, request_arena, response_arena,
                                 infer_frame=lambda call, payload: frame(call, INFER, payload),
                                 joined_frame=lambda call, payload: frame(call, INFER_JOINED, payload),
                                 answer_kind=ANSWER, joined_kind=JOINED_ANSWER, join=join, hold=hold)

    def _on_frame(self, call: int, kind: int, method: int, payload: bytes) -> None:
        if kind == RELEASE:
            if self._request_arena is not None:
                for offset in unpack_offsets(payload):
                    self._request_arena.free(offset)
            return
        future = self._pending.pop(call, None)
        if future is not None:
            if not future.done():
                future.set_result((0, payload) if kind == REPLY else (payload[0], payload[1:]))
        elif call in self._streams:
            self._streams[call].put_nowait((kind, payload))
        else:
            self._calls.on_frame(call, kind, payload)

    async def infer(self, request: InferRequest) -> Answer:
        """The answer, its outputs views on the response arena, and what to call once it is encoded (it lets
        their arena slot go); :class:`CallFailed` with the status the server process answered instead."""
        try:
            return await self._calls.infer(request)
        except Refused as refused:
            if refused.kind == END:
                raise CallFailed(refused.payload[0], refused.payload[1:]) from None
            raise CallFailed(grpc.StatusCode.UNAVAILABLE.value[0], GONE.encode()) from None

    async def unary(self, method: int, request: bytes) -> tuple[int, bytes]:
        """(status code, response bytes or error details)."""
        call = next(self._ids)
        future: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        self._pending[call] = future
        self.protocol.send(frame(call, CALL, request, method))
        try:
            return await future
        finally:
            self._pending.pop(call, None)

    def open(self, method: int) -> tuple[int, asyncio.Queue[tuple[int, bytes]]]:
        call = next(self._ids)
        queue = self._streams[call] = asyncio.Queue()
        self.protocol.send(frame(call, OPEN, b"", method))
        return call, queue

    def send(self, call: int, kind: int, payload: bytes = b"") -> None:
        self.protocol.send(frame(call, kind, payload))

    def forget(self, call: int) -> None:
        self._streams.pop(call, None)


async def _abort(context: Any, code: int, details: bytes) -> NoReturn:
    await context.abort(STATUS_CODES.get(code, grpc.StatusCode.UNKNOWN), details.decode(errors="replace"))
    raise AssertionError("context.abort() returned")  # pragma: no cover - grpc.aio's abort always raises


def _handlers(bridge: BridgeClient) -> list[grpc.GenericRpcHandler]:
    by_service: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
    for index, method in enumerate(METHODS):
        if index == MODEL_INFER:
            handler = grpc.unary_unary_rpc_method_handler(_infer_handler(bridge))
        elif method.streaming:
            handler = grpc.stream_stream_rpc_method_handler(_stream_handler(bridge, index))
        else:
            handler = grpc.unary_unary_rpc_method_handler(_unary_handler(bridge, index))
        by_service.setdefault(method.service, {})[method.name] = handler
    by_service[HEALTH_SERVICE]["Watch"] = grpc.unary_stream_rpc_method_handler(_watch_handler(bridge))
    return [grpc.method_handlers_generic_handler(service, methods) for service, methods in by_service.items()]


def _unary_handler(bridge: BridgeClient, index: int) -> Any:
    async def unary(request: bytes, context: Any) -> bytes:
        code, payload = await bridge.unary(index, request)
        if code:
            await _abort(context, code, payload)
        return payload
    return unary


def _infer_handler(bridge: BridgeClient) -> Any:
    """ModelInfer, decoded and encoded here as the in-process servicer does, the tensors in the arenas."""
    async def infer(payload: bytes, context: Any) -> bytes:
        request, refused, model = _decode(payload)
        # Dropped before any abort: its exception lists this frame, and grpc keeps that until the collector's
        # next full pass (see servicer.rpc), so nothing here may hold the request's bytes by then.
        del payload
        if request is None:
            if model is not None:
                await _abort_if_unknown(bridge, context, *model)
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT.value[0], refused.encode())
        try:
            response, release = await bridge.infer(request)
        except CallFailed as exc:
            failed: CallFailed | None = exc
        else:
            failed = None
        del request
        if failed is not None:
            await _abort(context, failed.code, failed.details)
        try:
            return bytes(codec.encode_response(response).SerializeToString())
        finally:
            release()  # the message holds a copy of every output now
    return infer


def _decode(payload: bytes) -> tuple[InferRequest | None, str, tuple[str, str] | None]:
    """The request; else None, what is wrong with it, and the (model, version) it names if it parsed."""
    try:
        return codec.decode_serialized(payload), "", None
    except codec.RefusedRequest as exc:
        return None, exc.message, (exc.model, exc.version)
    except InvalidArgumentError as exc:  # bytes that are no request: no model to name
        return None, exc.message, None


async def _abort_if_unknown(bridge: BridgeClient, context: Any, name: str, version: str) -> None:
    """Abort with NOT_FOUND when the server process has no such model: that comes before what else is wrong with
    a request, as in Triton."""
    query = pb.ModelMetadataRequest(name=name, version=version).SerializeToString()
    code, details = await bridge.unary(MODEL_METADATA, query)
    if code == grpc.StatusCode.NOT_FOUND.value[0]:
        await _abort(context, code, details)


def _stream_handler(bridge: BridgeClient, index: int) -> Any:
    async def stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        call, answers = bridge.open(index)

        async def forward() -> None:
            async for request in requests:
                bridge.send(call, MESSAGE, request)
            bridge.send(call, HALF_CLOSE)

        forwarding = asyncio.create_task(forward())
        ended = False
        try:
            while True:
                kind, payload = await answers.get()
                if kind == REPLY:
                    yield payload
                    continue
                ended = kind == END
                if payload[0]:
                    await _abort(context, payload[0], payload[1:])
                return
        finally:
            forwarding.cancel()
            bridge.forget(call)
            if not ended:
                bridge.send(call, CANCEL)
    return stream


def _watch_handler(bridge: BridgeClient) -> Any:
    """Health.Watch: the status now, then each change, read from the server process's Check."""
    check = method_index(HEALTH_SERVICE, "Check")

    async def watch(request: bytes, context: Any) -> AsyncIterator[bytes]:
        last = None
        while True:
            code, payload = await bridge.unary(check, request)
            if code == grpc.StatusCode.NOT_FOUND.value[0]:
                payload = health_pb2.HealthCheckResponse(
                    status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN).SerializeToString()
            elif code:
                await _abort(context, code, payload)
            if payload != last:
                yield payload
                last = payload
            await asyncio.sleep(HEALTH_POLL_S)
    return watch



async def run(args: argparse.Namespace) -> int:
    address, max_message_bytes, grace_s = args.address, args.max_message_bytes, args.grace
    bridge = BridgeClient(inherited_arena(args.request_arena_fd), inherited_arena(args.response_arena_fd),
                          join=joining_enabled(), hold=join_hold())
    await asyncio.get_running_loop().create_unix_connection(lambda: bridge.protocol,
                                                            sock=socket.socket(fileno=args.link_fd))
    server = grpc.aio.server(options=[
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 1),  # the workers share the port; the kernel spreads connections over them
        *GrpcConnectionLimits(args.keepalive_secs, args.max_connection_idle_secs).options(),
    ], interceptors=interceptors(policy_from_environment()))  # the server process's --grpc-restricted-protocol
    server.add_generic_rpc_handlers(_handlers(bridge))
    try:
        listen(server, address, tls_from_args(args.server_cert, args.server_key, args.root_cert, args.ssl_mutual))
    except RuntimeError as exc:
        print(f"gRPC worker: cannot listen on {address}: {exc}", file=sys.stderr)
        return 2
    await server.start()
    bridge.send(0, HELLO)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([stopping, bridge.protocol.closed], return_when=asyncio.FIRST_COMPLETED)
    lost = bridge.protocol.closed.done()
    await server.stop(grace=0 if lost else grace_s)
    stopping.cancel()
    return 1 if lost else 0


def main() -> int:
    parser = argparse.ArgumentParser(description="kiln gRPC worker (started by kiln serve --grpc-workers)")
    parser.add_argument("--link-fd", type=int, required=True, help="the socket to the server process")
    parser.add_argument("--request-arena-fd", type=int, default=-1)
    parser.add_argument("--response-arena-fd", type=int, default=-1)
    parser.add_argument("--address", required=True, help="HOST:PORT to serve gRPC on")
    parser.add_argument("--max-message-bytes", type=int, required=True)
    parser.add_argument("--grace", type=float, default=30.0, help="seconds in-flight calls get after SIGTERM")
    parser.add_argument("--server-cert", type=Path, help="serve TLS with this PEM certificate (--grpc-use-ssl)")
    parser.add_argument("--server-key", type=Path)
    parser.add_argument("--root-cert", type=Path)
    parser.add_argument("--ssl-mutual", action="store_true", help="require client certificates from --root-cert")
    parser.add_argument("--keepalive-secs", type=float, default=GrpcConnectionLimits.keepalive_s)
    parser.add_argument("--max-connection-idle-secs", type=float, default=GrpcConnectionLimits.max_connection_idle_s)
    args = parser.parse_args()
    # A Ctrl-C reaches the whole process group; the server process answers it by stopping the workers in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_freed_heap()  # request messages are freed every request: their pages stay (kiln/heap.py)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run(args))
    return uvloop.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
