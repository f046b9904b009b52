"""Start the gRPC frontend: Triton's GRPCInferenceService plus the standard ``grpc.health.v1.Health`` service.

Health answers SERVING while :meth:`Server.ready` is true and NOT_SERVING otherwise, both for the whole server
(service ``""``) and for ``inference.GRPCInferenceService``; the state is read from the Server on every Check, and
every :data:`HEALTH_POLL_S` seconds while a Watch is open.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # type: ignore[import-untyped]  # no type info

from kiln.frontends.access import AccessPolicy
from kiln.frontends.grpc.access import GrpcTls, interceptors, listen
from kiln.frontends.grpc.servicer import RAW_REQUEST_METHODS, GRPCInferenceService
from kiln.server.server import Server
from kiln.v2._generated import grpc_service_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
SERVICE_NAME: str = SERVICE.full_name
MAX_MESSAGE_BYTES = 2**31 - 1
"""Triton's limit (INT32_MAX) for both directions."""
HEALTH_POLL_S = 1.0
"""How often an open health Watch re-reads the Server's readiness."""


@dataclass(frozen=True)
class GrpcConnectionLimits:
    """grpc core's connection management, which grpcio otherwise leaves at: no idle limit, keepalive pings after
    two hours."""

    keepalive_s: float = 7200.0
    """Ping a client after this long without activity; close its connection when the ping goes unanswered for
    :data:`KEEPALIVE_TIMEOUT_S`."""
    max_connection_idle_s: float = 3600.0
    """Send GOAWAY to a connection with no call in progress for this long (0: never); clients reconnect."""

    def options(self) -> list[tuple[str, int]]:
        options = [("grpc.keepalive_time_ms", int(self.keepalive_s * 1000)),
                   ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000))]
        if self.max_connection_idle_s > 0:
            options.append(("grpc.max_connection_idle_ms", int(self.max_connection_idle_s * 1000)))
        return options


KEEPALIVE_TIMEOUT_S = 20.0
"""How long a keepalive ping may go unanswered (grpc core's default)."""


class ReadinessHealth:
    """``grpc.health.v1.Health`` whose status follows the Server's readiness (grpc's own servicer underneath)."""

    def __init__(self, server: Server) -> None:
        self._server = server
        self._health = health.aio.HealthServicer()

    async def _refresh(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        state = serving if self._server.ready() else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in (health.OVERALL_HEALTH, SERVICE_NAME):
            await self._health.set(service, state)

    async def Check(self, request: Any, context: Any) -> Any:
        await self._refresh()
        return await self._health.Check(request, context)

    async def Watch(self, request: Any, context: Any) -> None:
        await self._refresh()
        poller = asyncio.create_task(self._poll())
        try:
            await self._health.Watch(request, context)
        finally:
            poller.cancel()

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            await self._refresh()


def method_handlers(servicer: GRPCInferenceService) -> dict[str, grpc.RpcMethodHandler]:
    """The service's methods as the generated ``add_..._to_server`` makes them, except that every request arrives
    as bytes: the methods in :data:`RAW_REQUEST_METHODS` parse them in the servicer, the others here, so bytes that
    are no request message answer INVALID_ARGUMENT (grpc's own deserializer would answer UNKNOWN)."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in SERVICE.methods:
        behaviour = getattr(servicer, method.name)
        if method.name not in RAW_REQUEST_METHODS:
            behaviour = _parsed(method.name, getattr(pb, method.input_type.name), behaviour)
        kind = grpc.stream_stream_rpc_method_handler if method.client_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = kind(behaviour, request_deserializer=None, response_serializer=_serialize)
    return handlers


def _parsed(name: str, request_type: Any, behaviour: Any) -> Any:
    """A unary method taking bytes: parsed into ``request_type``, then handed to ``behaviour``."""
    async def unary(payload: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            request = request_type.FromString(payload)
        except Exception as exc:  # protobuf's DecodeError: bytes that are no such message
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"could not parse the {name} request ({len(payload)} bytes): {exc}")
        return await behaviour(request, context)
    return unary


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


async def start_grpc_server(server: Server, host: str, port: int, *, max_message_bytes: int = MAX_MESSAGE_BYTES,
                            limits: GrpcConnectionLimits | None = None, access: AccessPolicy | None = None,
                            tls: GrpcTls | None = None) -> tuple[grpc.aio.Server, int]:
    """Serve ``server`` over gRPC on ``host:port`` (port 0 picks a free port) and return the started
    ``grpc.aio.Server`` with the port it bound. Stop it with ``await grpc_server.stop(grace)``. ``access``:
    the restricted protocol groups; ``tls``: serve over TLS (access.py)."""
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),  # a port already in use is an error, not a silently shared listener
        *(limits or GrpcConnectionLimits()).options(),
    ]
    grpc_server = grpc.aio.server(options=options, interceptors=interceptors(access))
    handlers = method_handlers(GRPCInferenceService(server))
    # Registered as the generated code registers them: by name (grpc's fast path), and as a generic handler.
    grpc_server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)])
    grpc_server.add_registered_method_handlers(SERVICE.full_name, handlers)
    health_pb2_grpc.add_HealthServicer_to_server(ReadinessHealth(server), grpc_server)
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound = listen(grpc_server, address, tls)
    except RuntimeError as exc:  # grpcio raises on a failed bind (older versions returned 0)
        raise OSError(f"gRPC frontend: cannot listen on {address}: {exc}") from None
    if not bound:
        raise OSError(f"gRPC frontend: cannot listen on {address} (address in use or not available)")
    await grpc_server.start()
    return grpc_server, int(bound)
