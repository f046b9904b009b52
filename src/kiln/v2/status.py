"""The one table from kiln's ErrorCode to HTTP status and gRPC code, mirroring Triton, in both directions.

Nothing else in kiln knows transport status codes: frontends call :func:`http_status` / :func:`grpc_code` with the
error they caught, and clients call :func:`error_from_http` to turn an error answer back into the typed error.
Unexpected exceptions are INTERNAL. gRPC codes are kept by name, so that this module (and the HTTP client) work
on a core install without grpcio.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kiln.errors import ErrorCode, InternalError, KilnError, error_for_code

if TYPE_CHECKING:
    import grpc

log = logging.getLogger("kiln.frontends")

_TABLE: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.INVALID_ARG: (400, "INVALID_ARGUMENT"),
    ErrorCode.NOT_FOUND: (404, "NOT_FOUND"),
    ErrorCode.UNAVAILABLE: (503, "UNAVAILABLE"),
    ErrorCode.UNSUPPORTED: (501, "UNIMPLEMENTED"),
    ErrorCode.ALREADY_EXISTS: (400, "ALREADY_EXISTS"),
    ErrorCode.CANCELLED: (400, "CANCELLED"),
    ErrorCode.INTERNAL: (500, "INTERNAL"),
    ErrorCode.UNKNOWN: (400, "UNKNOWN"),
    # kiln's access-control errors, which Triton's eight codes lack: the standard HTTP and gRPC pair of each.
    ErrorCode.UNAUTHENTICATED: (401, "UNAUTHENTICATED"),
    ErrorCode.PERMISSION_DENIED: (403, "PERMISSION_DENIED"),
}
# HTTP answers lose the difference between the 400 codes; a client reads them back as INVALID_ARG.
_FROM_HTTP: dict[int, ErrorCode] = {401: ErrorCode.UNAUTHENTICATED, 403: ErrorCode.PERMISSION_DENIED,
                                    404: ErrorCode.NOT_FOUND, 501: ErrorCode.UNSUPPORTED,
                                    503: ErrorCode.UNAVAILABLE, 500: ErrorCode.INTERNAL}
_FROM_GRPC: dict[str, ErrorCode] = {name: code for code, (_, name) in _TABLE.items()}


def as_kiln_error(exc: BaseException) -> KilnError:
    """Typed errors pass through; anything else is an INTERNAL error, logged once with its traceback."""
    if isinstance(exc, KilnError):
        return exc
    log.error("unexpected error", exc_info=exc)
    return InternalError(f"internal error: {type(exc).__name__}: {exc}")


def http_status(error: KilnError) -> int:
    return _TABLE[error.code][0]


def grpc_code(error: KilnError) -> grpc.StatusCode:
    import grpc

    return grpc.StatusCode[_TABLE[error.code][1]]


def error_body(error: KilnError) -> dict[str, str]:
    return {"error": error.message}


def error_from_http(status: int, message: str) -> KilnError:
    """The typed error an HTTP error answer stands for (any other 4xx is INVALID_ARG, any other 5xx INTERNAL)."""
    code = _FROM_HTTP.get(status, ErrorCode.INVALID_ARG if status < 500 else ErrorCode.INTERNAL)
    return error_for_code(code, message)


def error_from_grpc(code_name: str, message: str) -> KilnError:
    """The typed error a gRPC status (by name, e.g. ``"NOT_FOUND"``) stands for."""
    return error_for_code(_FROM_GRPC.get(code_name, ErrorCode.UNKNOWN), message)
