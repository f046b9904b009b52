"""The one table from kiln's ErrorCode to HTTP status and gRPC code, mirroring Triton.

Nothing else in kiln knows transport status codes: frontends call :func:`http_status` / :func:`grpc_code` with the
error they caught. Unexpected exceptions are INTERNAL.
"""

from __future__ import annotations

import logging

import grpc

from kiln.errors import ErrorCode, InternalError, KilnError

log = logging.getLogger("kiln.frontends")

_TABLE: dict[ErrorCode, tuple[int, grpc.StatusCode]] = {
    ErrorCode.INVALID_ARG: (400, grpc.StatusCode.INVALID_ARGUMENT),
    ErrorCode.NOT_FOUND: (404, grpc.StatusCode.NOT_FOUND),
    ErrorCode.UNAVAILABLE: (503, grpc.StatusCode.UNAVAILABLE),
    ErrorCode.UNSUPPORTED: (501, grpc.StatusCode.UNIMPLEMENTED),
    ErrorCode.ALREADY_EXISTS: (400, grpc.StatusCode.ALREADY_EXISTS),
    ErrorCode.CANCELLED: (400, grpc.StatusCode.CANCELLED),
    ErrorCode.INTERNAL: (500, grpc.StatusCode.INTERNAL),
    ErrorCode.UNKNOWN: (400, grpc.StatusCode.UNKNOWN),
}


def as_kiln_error(exc: BaseException) -> KilnError:
    """Typed errors pass through; anything else is an INTERNAL error, logged once with its traceback."""
    if isinstance(exc, KilnError):
        return exc
    log.error("unexpected error", exc_info=exc)
    return InternalError(f"internal error: {type(exc).__name__}: {exc}")


def http_status(error: KilnError) -> int:
    return _TABLE[error.code][0]


def grpc_code(error: KilnError) -> grpc.StatusCode:
    return _TABLE[error.code][1]


def error_body(error: KilnError) -> dict[str, str]:
    return {"error": error.message}
