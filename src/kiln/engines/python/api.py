"""The two ways a model.py can talk to kiln, behind one small interface the engine uses.

kiln's own API (class ``KilnModel``): ``execute(requests)`` gets a list of :class:`Request` (``.inputs``: a dict
of input name to numpy array, ``.requested_outputs``: the output names wanted) and returns one dict of output
name to numpy array per request. A request that failed may be answered with an exception instance instead of a
dict; kiln errors (``kiln.errors``) keep their code, any other exception is reported as INTERNAL.

Triton's API (class ``TritonPythonModel``): requests are ``pb_utils.InferenceRequest`` and responses
``pb_utils.InferenceResponse``; a response's ``TritonError`` becomes the kiln error with the same code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kiln.engines.python import compat
from kiln.errors import (
    AlreadyExistsError,
    CancelledError,
    InternalError,
    InvalidArgumentError,
    KilnError,
    NotFoundError,
    UnavailableError,
    UnknownError,
    UnsupportedError,
)


@dataclass(frozen=True)
class Request:
    """One request as kiln's API hands it to ``KilnModel.execute``. With batching, every input carries the batch
    dimension first."""

    inputs: Mapping[str, Any]
    requested_outputs: tuple[str, ...] = field(default_factory=tuple)


class Adapter(Protocol):
    """Builds the request objects a model's ``execute`` takes and reads back the tensors it returned."""

    def requests(self, inputs: Mapping[str, Any], outputs: Sequence[str]) -> list[Any]: ...

    def outputs(self, result: object, count: int) -> Mapping[str, Any]: ...


_TRITON_CODES: dict[int, type[KilnError]] = {
    compat.TritonError.UNKNOWN: UnknownError,
    compat.TritonError.INTERNAL: InternalError,
    compat.TritonError.NOT_FOUND: NotFoundError,
    compat.TritonError.INVALID_ARG: InvalidArgumentError,
    compat.TritonError.UNAVAILABLE: UnavailableError,
    compat.TritonError.UNSUPPORTED: UnsupportedError,
    compat.TritonError.ALREADY_EXISTS: AlreadyExistsError,
    compat.TritonError.CANCELLED: CancelledError,
}


class TritonAdapter:
    def __init__(self, model_name: str) -> None:
        self._model = model_name

    def requests(self, inputs: Mapping[str, Any], outputs: Sequence[str]) -> list[Any]:
        tensors = [compat.Tensor(name, array) for name, array in inputs.items()]
        return [compat.InferenceRequest(model_name=self._model, requested_output_names=list(outputs),
                                        inputs=tensors)]

    def outputs(self, result: object, count: int) -> Mapping[str, Any]:
        response = _single(self._model, result, count, "InferenceResponse")
        if not isinstance(response, compat.InferenceResponse):
            raise InternalError(f"model '{self._model}': execute() must return pb_utils.InferenceResponse objects; "
                                f"found {type(response).__name__}")
        error = response.error()
        if error is not None:
            raise triton_error(self._model, error)
        tensors: dict[str, Any] = {}
        for tensor in response.output_tensors():
            if not isinstance(tensor, compat.Tensor):
                raise InternalError(f"model '{self._model}': InferenceResponse output_tensors must be pb_utils.Tensor "
                                    f"objects; found {type(tensor).__name__}")
            _add(self._model, tensors, tensor.name(), tensor.as_numpy())
        return tensors


class KilnAdapter:
    def __init__(self, model_name: str) -> None:
        self._model = model_name

    def requests(self, inputs: Mapping[str, Any], outputs: Sequence[str]) -> list[Any]:
        return [Request(inputs=dict(inputs), requested_outputs=tuple(outputs))]

    def outputs(self, result: object, count: int) -> Mapping[str, Any]:
        response = _single(self._model, result, count, "dict of output name to array")
        if isinstance(response, KilnError):
            raise named(response, self._model)
        if isinstance(response, Exception):
            raise InternalError(f"model '{self._model}': {type(response).__name__}: {response}")
        if not isinstance(response, Mapping):
            raise InternalError(f"model '{self._model}': execute() must return a dict of output name to array per "
                                f"request; found {type(response).__name__}")
        return response


def triton_error(model: str, error: compat.TritonError) -> KilnError:
    """The kiln error with the code of a response's ``TritonError``."""
    return _TRITON_CODES.get(error.code(), UnknownError)(f"model '{model}': {error.message()}")


def named(error: KilnError, model: str) -> KilnError:
    """``error`` with a message that starts with the model's name (a new error of the same class)."""
    prefix = f"model '{model}'"
    if error.message.startswith(prefix):
        return error
    try:
        return type(error)(f"{prefix}: {error.message}")
    except TypeError:  # a subclass with its own constructor: keep it as it is
        return error


def _single(model: str, result: object, count: int, what: str) -> object:
    if result is None:
        raise InternalError(f"model '{model}': execute() returned None; return one response per request, or set "
                            f"model_transaction_policy {{ decoupled: true }} to answer through response senders")
    if not isinstance(result, (list, tuple)):
        raise InternalError(f"model '{model}': execute() must return a list with one {what} per request; "
                            f"it returned {type(result).__name__}")
    if len(result) != count:
        raise InternalError(f"model '{model}': execute() returned {len(result)} responses for {count} "
                            f"request(s); return exactly one per request")
    return result[0]


def _add(model: str, tensors: dict[str, Any], name: str, array: Any) -> None:
    if name in tensors:
        raise InternalError(f"model '{model}': execute() returned output '{name}' twice in one response")
    tensors[name] = array
