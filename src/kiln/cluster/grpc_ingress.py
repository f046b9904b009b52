"""Triton's gRPC protocol (``inference.GRPCInferenceService``) through Ray Serve's gRPC proxy.

Ray Serve's proxy registers the service from its generated ``add_..._to_server`` function and calls, for each RPC,
the ingress deployment's method of the same name with the decoded request and a ``grpc_context`` keyword argument.
So every replica answers with kiln's own servicer (frontends/grpc/servicer.py), and errors keep kiln's status codes
and messages: kiln's servicer aborts through the context, which here sets the code and details on Ray's context and
raises, and Ray's proxy answers with that code. The bidirectional ``ModelStreamInfer`` is not carried (Ray hands a
replica a stream session of its own, not an iterator of requests); unary RPCs are."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

from google.protobuf import json_format

from kiln.frontends.grpc.servicer import GRPCInferenceService
from kiln.v2._generated import grpc_service_pb2 as pb
from kiln.v2._generated.grpc_service_pb2_grpc import add_GRPCInferenceServiceServicer_to_server

# What Serve's gRPC options name: the proxy imports it to learn the service's methods.
SERVICER_FUNCTION = "kiln.cluster.grpc_ingress.add_service_to_serve_proxy"
NOT_CARRIED = frozenset({"ModelStreamInfer"})


def add_service_to_serve_proxy(servicer: Any, server: Any) -> None:
    """The generated ``add_..._to_server`` with only its generic handler: Serve's proxy replaces the generic
    handlers' functions with its own routing, but not those of ``add_registered_method_handlers`` (which grpcio's
    newer generated code also calls), and those would be found first and call Serve's placeholder servicer."""
    add_GRPCInferenceServiceServicer_to_server(servicer, _GenericHandlersOnly(server))  # type: ignore[no-untyped-call]


class _GenericHandlersOnly:
    def __init__(self, server: Any) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers: Any) -> None:
        pass  # see add_service_to_serve_proxy


class GRPCAborted(Exception):
    """Raised after the status was set on Ray's context: the proxy answers with that status."""


class RayContext:
    """What kiln's servicer needs of a ``grpc.aio.ServicerContext``, over Ray Serve's gRPC context."""

    def __init__(self, context: Any) -> None:
        self._context = context

    async def abort(self, code: Any, details: str) -> NoReturn:
        self._context.set_code(code)
        self._context.set_details(details)
        raise GRPCAborted(details)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def _forward(rpc: str) -> Callable[..., Awaitable[Any]]:
    # Ray passes the context only to a method with a parameter named grpc_context.
    async def method(self: Any, request: Any, grpc_context: Any) -> Any:
        return await call_servicer(self.grpc_servicer, rpc, request, grpc_context)

    method.__name__ = method.__qualname__ = rpc
    return method


def unary_rpcs() -> list[str]:
    return sorted(name for name in vars(GRPCInferenceService) if name[0].isupper() and name not in NOT_CARRIED)


def with_grpc_methods(cls: type) -> type:
    """``cls`` (whose instances have ``grpc_servicer``) with one method per unary RPC of the service, except those
    ``cls`` defines itself."""
    for rpc in unary_rpcs():
        if rpc not in vars(cls):
            setattr(cls, rpc, _forward(rpc))
    return cls


async def call_servicer(servicer: GRPCInferenceService, rpc: str, request: Any, grpc_context: Any) -> Any:
    """One RPC answered by kiln's servicer, its errors set on Serve's context."""
    return await getattr(servicer, rpc)(request, RayContext(grpc_context))


def statistics_response(document: list[dict[str, Any]]) -> pb.ModelStatisticsResponse:
    """The statistics extension's JSON entries as the gRPC answer: the HTTP document is the protobuf's JSON form,
    so the fields map one to one."""
    return json_format.ParseDict({"model_stats": document}, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)
