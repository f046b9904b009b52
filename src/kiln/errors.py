"""Typed errors raised by every layer of kiln.

Each error carries an :class:`ErrorCode`: Triton's eight codes, and two of access control (a missing or wrong
key, and an endpoint the server was not started to serve). Frontends map the code to an HTTP status or a
gRPC code in one place (``kiln.v2.status``); nothing else in kiln knows about transports.

The tree::

    KilnError
    +-- InvalidArgumentError          INVALID_ARG     bad input, bad config, wrong name / dtype / shape
    |   +-- ConfigError               a config.pbtxt or repository problem, names the file
    +-- NotFoundError                 NOT_FOUND
    |   +-- ModelNotFoundError        unknown model or version
    +-- UnavailableError              UNAVAILABLE
    |   +-- ModelNotReadyError        known but not loaded / loading / unloading
    |   |   +-- VersionUnloadingError the version was just replaced or unloaded
    |   +-- QueueFullError            the model's queue is full
    |   +-- RequestTimeoutError       the request timed out in the queue
    +-- UnsupportedError              UNSUPPORTED     a feature or backend kiln does not provide here
    +-- AlreadyExistsError            ALREADY_EXISTS
    +-- CancelledError                CANCELLED
    +-- InternalError                 INTERNAL        an engine failed; unexpected exceptions become this
    +-- UnknownError                  UNKNOWN
    +-- UnauthenticatedError          UNAUTHENTICATED    the request lacks the server's API key
    +-- PermissionDeniedError         PERMISSION_DENIED  an endpoint this server was not started to serve

Messages name the model, version, field and value involved and say what was expected.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    INVALID_ARG = "INVALID_ARG"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    UNSUPPORTED = "UNSUPPORTED"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"
    UNKNOWN = "UNKNOWN"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"


class KilnError(Exception):
    """Base of every error kiln raises on purpose."""

    code: ErrorCode = ErrorCode.UNKNOWN
    # Set on a request's error when it was refused before any model ran (admission, validation): what is wrong
    # may then be one member's of a joined request, and each member can run on its own (frontends/handoff).
    before_running: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidArgumentError(KilnError):
    code = ErrorCode.INVALID_ARG


class ConfigError(InvalidArgumentError):
    """A model configuration or repository layout that kiln cannot use."""


class NotFoundError(KilnError):
    code = ErrorCode.NOT_FOUND


class ModelNotFoundError(NotFoundError):
    pass


class UnavailableError(KilnError):
    code = ErrorCode.UNAVAILABLE


class ModelNotReadyError(UnavailableError):
    pass


class VersionUnloadingError(ModelNotReadyError):
    """The version stopped taking requests (replaced or unloaded); a newer one may serve the request."""


class QueueFullError(UnavailableError):
    pass


class RequestTimeoutError(UnavailableError):
    pass


class UnsupportedError(KilnError):
    code = ErrorCode.UNSUPPORTED


class AlreadyExistsError(KilnError):
    code = ErrorCode.ALREADY_EXISTS


class CancelledError(KilnError):
    code = ErrorCode.CANCELLED


class InternalError(KilnError):
    code = ErrorCode.INTERNAL


class UnknownError(KilnError):
    code = ErrorCode.UNKNOWN


class UnauthenticatedError(KilnError):
    code = ErrorCode.UNAUTHENTICATED


class PermissionDeniedError(KilnError):
    code = ErrorCode.PERMISSION_DENIED


_BY_CODE: dict[ErrorCode, type[KilnError]] = {
    ErrorCode.INVALID_ARG: InvalidArgumentError, ErrorCode.NOT_FOUND: NotFoundError,
    ErrorCode.UNAVAILABLE: UnavailableError, ErrorCode.UNSUPPORTED: UnsupportedError,
    ErrorCode.ALREADY_EXISTS: AlreadyExistsError, ErrorCode.CANCELLED: CancelledError,
    ErrorCode.INTERNAL: InternalError, ErrorCode.UNKNOWN: UnknownError,
    ErrorCode.UNAUTHENTICATED: UnauthenticatedError, ErrorCode.PERMISSION_DENIED: PermissionDeniedError,
}


def error_for_code(code: ErrorCode, message: str) -> KilnError:
    """The base error of ``code`` (what a client rebuilds from a status it received)."""
    return _BY_CODE[code](message)


__all__ = [
    "AlreadyExistsError",
    "CancelledError",
    "ConfigError",
    "ErrorCode",
    "InternalError",
    "InvalidArgumentError",
    "KilnError",
    "ModelNotFoundError",
    "ModelNotReadyError",
    "NotFoundError",
    "PermissionDeniedError",
    "QueueFullError",
    "RequestTimeoutError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnknownError",
    "UnsupportedError",
    "VersionUnloadingError",
    "error_for_code",
]
