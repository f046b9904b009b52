"""The error tree: each class carries the right ErrorCode and sits where the module docstring says."""

from __future__ import annotations

import asyncio

import pytest

from kiln import errors
from kiln.errors import (
    AlreadyExistsError,
    CancelledError,
    ConfigError,
    ErrorCode,
    InternalError,
    InvalidArgumentError,
    KilnError,
    ModelNotFoundError,
    ModelNotReadyError,
    NotFoundError,
    PermissionDeniedError,
    QueueFullError,
    RequestTimeoutError,
    UnauthenticatedError,
    UnavailableError,
    UnknownError,
    UnsupportedError,
    VersionUnloadingError,
)

# (class, code, direct parent) exactly as drawn in kiln.errors' docstring.
TREE: list[tuple[type[KilnError], ErrorCode, type[Exception]]] = [
    (KilnError, ErrorCode.UNKNOWN, Exception),
    (InvalidArgumentError, ErrorCode.INVALID_ARG, KilnError),
    (ConfigError, ErrorCode.INVALID_ARG, InvalidArgumentError),
    (NotFoundError, ErrorCode.NOT_FOUND, KilnError),
    (ModelNotFoundError, ErrorCode.NOT_FOUND, NotFoundError),
    (UnavailableError, ErrorCode.UNAVAILABLE, KilnError),
    (ModelNotReadyError, ErrorCode.UNAVAILABLE, UnavailableError),
    (VersionUnloadingError, ErrorCode.UNAVAILABLE, ModelNotReadyError),
    (QueueFullError, ErrorCode.UNAVAILABLE, UnavailableError),
    (RequestTimeoutError, ErrorCode.UNAVAILABLE, UnavailableError),
    (UnsupportedError, ErrorCode.UNSUPPORTED, KilnError),
    (AlreadyExistsError, ErrorCode.ALREADY_EXISTS, KilnError),
    (CancelledError, ErrorCode.CANCELLED, KilnError),
    (InternalError, ErrorCode.INTERNAL, KilnError),
    (UnknownError, ErrorCode.UNKNOWN, KilnError),
    (UnauthenticatedError, ErrorCode.UNAUTHENTICATED, KilnError),
    (PermissionDeniedError, ErrorCode.PERMISSION_DENIED, KilnError),
]


def test_error_codes_are_tritons_eight_and_two_of_access_control() -> None:
    assert {code.value for code in ErrorCode} == {
        "INVALID_ARG", "NOT_FOUND", "UNAVAILABLE", "UNSUPPORTED", "ALREADY_EXISTS", "CANCELLED", "INTERNAL", "UNKNOWN",
        "UNAUTHENTICATED", "PERMISSION_DENIED",
    }
    assert all(code.name == code.value for code in ErrorCode)


@pytest.mark.parametrize(("cls", "code", "parent"), TREE, ids=[c.__name__ for c, _, _ in TREE])
def test_class_code_and_parent(cls: type[KilnError], code: ErrorCode, parent: type[Exception]) -> None:
    assert cls.code is code
    assert cls.__bases__ == (parent,)
    assert issubclass(cls, KilnError)
    instance = cls("model 'm': boom")
    assert instance.code is code
    assert isinstance(instance, parent)


def test_every_code_has_a_class() -> None:
    assert {code for _, code, _ in TREE} == set(ErrorCode)


def test_subclasses_outside_their_branch_do_not_match() -> None:
    assert not issubclass(ConfigError, NotFoundError)
    assert not issubclass(ModelNotFoundError, InvalidArgumentError)
    assert not issubclass(QueueFullError, InternalError)
    # kiln's CancelledError is its own class, not asyncio's: catching one never swallows the other.
    assert not issubclass(CancelledError, asyncio.CancelledError)
    assert not issubclass(asyncio.CancelledError, KilnError)


def test_message_is_str_and_attribute() -> None:
    error = ModelNotFoundError("model 'resnet' has no version 3 (available: 1, 2)")
    assert str(error) == error.message == "model 'resnet' has no version 3 (available: 1, 2)"
    assert error.args == ("model 'resnet' has no version 3 (available: 1, 2)",)
    with pytest.raises(NotFoundError, match="no version 3"):
        raise error


def test_module_all_lists_every_error_class() -> None:
    exported = {name for name in errors.__all__ if name not in ("ErrorCode", "error_for_code")}
    assert exported == {cls.__name__ for cls, _, _ in TREE}
    for name in errors.__all__:
        assert getattr(errors, name) is not None


def test_docstring_tree_names_every_class() -> None:
    doc = errors.__doc__ or ""
    for cls, _, _ in TREE:
        assert cls.__name__ in doc
    for code in ErrorCode:
        assert code.value in doc


@pytest.mark.parametrize("code", list(ErrorCode))
def test_error_for_code_rebuilds_an_error_with_that_code(code: ErrorCode) -> None:
    error = errors.error_for_code(code, "what the server said")
    assert error.code is code and error.message == "what the server said"
