"""gRPC access control and TLS: the restricted protocol groups (``--grpc-restricted-protocol``) as a grpc.aio
server interceptor, and the server credentials of ``--grpc-use-ssl``. The in-process server (server.py) and every
worker process (worker.py) install both, so a call is checked where it arrives."""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import grpc

from kiln.errors import InvalidArgumentError, KilnError
from kiln.frontends.access import AccessPolicy, grpc_group
from kiln.v2.status import grpc_code


class RestrictedProtocols(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc.aio: no stubs for it
    """Answers PERMISSION_DENIED to a call of a restricted group whose metadata lacks the group's
    ``triton-grpc-protocol-<key>`` with its value; other calls reach their handler untouched."""

    def __init__(self, policy: AccessPolicy) -> None:
        self.policy = policy

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        group = grpc_group(handler_call_details.method)
        if handler is None or group is None or self.policy.header(group) is None:
            return handler
        metadata = {key.lower(): value for key, value in handler_call_details.invocation_metadata or ()
                    if isinstance(value, str)}  # binary (-bin) values cannot hold the header
        try:
            self.policy.check(group, metadata)
        except KilnError as exc:
            return _refusing(handler, exc)
        return handler


def _refusing(handler: grpc.RpcMethodHandler, error: KilnError) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind (so requests still decode) that ends the call with ``error``."""
    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> NoReturn:
        await context.abort(grpc_code(error), error.message)
        raise AssertionError("context.abort() returned")  # pragma: no cover - grpc.aio's abort always raises

    codecs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, **codecs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse, **codecs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **codecs)
    return grpc.stream_stream_rpc_method_handler(refuse, **codecs)


def interceptors(policy: AccessPolicy | None) -> list[grpc.aio.ServerInterceptor]:
    """What a gRPC server installs for ``policy``: nothing when it restricts nothing (no cost per call)."""
    return [RestrictedProtocols(policy)] if policy else []


@dataclass(frozen=True)
class GrpcTls:
    """``--grpc-use-ssl``: the server's PEM certificate (chain) and key; ``mutual`` (--grpc-use-ssl-mutual):
    clients must present a certificate that ``root_cert`` (a PEM CA bundle) signed."""

    cert: Path
    key: Path
    root_cert: Path | None = None
    mutual: bool = False

    def __post_init__(self) -> None:
        """Load the files as TLS will, so that a bad one is named here: gRPC itself only fails to bind."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.cert, self.key)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise InvalidArgumentError(f"--grpc-server-cert '{self.cert}' with --grpc-server-key '{self.key}': "
                                       f"expected a PEM certificate chain and its private key ({exc})") from None
        if self.root_cert is not None:
            try:
                context.load_verify_locations(self.root_cert)
            except (OSError, ValueError) as exc:
                raise InvalidArgumentError(f"--grpc-root-cert '{self.root_cert}': expected a PEM CA bundle "
                                           f"({exc})") from None

    def credentials(self) -> grpc.ServerCredentials:
        root = self.root_cert.read_bytes() if self.root_cert is not None else None
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())],
                                           root_certificates=root, require_client_auth=self.mutual)

    def worker_args(self) -> list[str]:
        """How a worker process is told (worker.py reads them back with :func:`tls_from_args`)."""
        args = ["--server-cert", str(self.cert), "--server-key", str(self.key)]
        if self.root_cert is not None:
            args += ["--root-cert", str(self.root_cert)]
        return args + (["--ssl-mutual"] if self.mutual else [])


def tls_from_args(cert: Path | None, key: Path | None, root_cert: Path | None, mutual: bool) -> GrpcTls | None:
    return GrpcTls(cert, key, root_cert, mutual) if cert is not None and key is not None else None


def listen(server: grpc.aio.Server, address: str, tls: GrpcTls | None) -> int:
    """Add the port at ``address`` (TLS with ``tls``) and return the port bound; 0 when it cannot be bound (older
    grpcio) or raises RuntimeError (newer)."""
    if tls is None:
        return int(server.add_insecure_port(address))
    return int(server.add_secure_port(address, tls.credentials()))
