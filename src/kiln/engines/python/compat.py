"""Triton's Python-backend API (``triton_python_backend_utils``), served in-process by kiln.

A model.py written for Triton does ``import triton_python_backend_utils as pb_utils``; kiln registers this module
under that name in ``sys.modules`` before it imports a Python model, so the model runs unchanged. Covered: Tensor,
InferenceRequest, InferenceResponse, TritonError (with Triton's codes), TritonModelException, Logger, the config
helpers and ModelConfig (auto-complete), calls to other models (BLS ``InferenceRequest.exec``, see bls.py) and
the response senders of decoupled models (decoupled.py). Not covered: request rescheduling, custom metrics and GPU
tensors; each raises kiln's UnsupportedError with the reason.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import numpy.typing as npt

from kiln.engines.python import bls
from kiln.engines.python.model_config import ModelConfig
from kiln.errors import InvalidArgumentError, UnsupportedError
from kiln.tensor import DataType, decode_bytes, encode_bytes

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Iterator

    from kiln.engines.python.decoupled import ResponseSender

Array = npt.NDArray[Any]

_log = logging.getLogger("kiln.python_model")

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
TRITONSERVER_MEMORY_CPU = 0
TRITONSERVER_MEMORY_GPU = 2

TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    t.config_name: (np.object_ if t is DataType.BYTES else t.numpy_dtype.type) for t in DataType
}
TRITON_STRING_TO_NUMPY["TYPE_BOOL"] = bool  # Triton's table maps it to the builtin


class TritonModelException(Exception):
    """Raised by a model (or by this module) to fail initialize, execute or finalize."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self._msg = msg

    def message(self) -> str:
        return self._msg


class TritonError:
    """A per-response error (``InferenceResponse(error=TritonError(msg, code))``); codes are Triton's."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, msg: str, code: int = INTERNAL) -> None:
        self._msg = msg
        self._code = code

    def message(self) -> str:
        return self._msg

    def code(self) -> int:
        return self._code

    def __str__(self) -> str:
        return self._msg


class Tensor:
    """A named numpy array. Always in CPU memory in kiln; DLPack hands it to torch and others without a copy."""

    def __init__(self, name: str, numpy_array: Any) -> None:
        array = np.asarray(numpy_array)
        if array.dtype.kind in ("U", "V"):
            raise TritonModelException(f"tensor '{name}' has numpy dtype {array.dtype}, which the Python backend "
                                       f"does not support; use dtype=np.object_ with bytes elements for strings")
        self._name = name
        self._array = array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> Array:
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def triton_dtype(self) -> int:
        return DataType.from_numpy(self._array.dtype).config_number

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        return self.__dlpack__()

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        self._require_numeric("to_dlpack")
        # DLPack cannot mark memory read-only, and numpy refuses to export such arrays: hand over a copy.
        array = self._array if self._array.flags.writeable else self._array.copy()
        return array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU, device 0

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        source = capsule if hasattr(capsule, "__dlpack__") else _Capsule(capsule)
        try:
            array = np.from_dlpack(source)
        except (BufferError, RuntimeError, TypeError) as exc:
            raise TritonModelException(f"tensor '{name}': cannot read the DLPack tensor ({exc}); kiln's Python "
                                       f"backend takes C-contiguous CPU tensors only") from None
        return Tensor(name, array)

    def _require_numeric(self, what: str) -> None:
        if self._array.dtype.kind in ("O", "S"):
            raise TritonModelException(f"tensor '{self._name}': {what} needs a numeric tensor; BYTES tensors have "
                                       f"no DLPack form")


class _Capsule:
    """A bare DLPack capsule (torch.utils.dlpack.to_dlpack) in the protocol np.from_dlpack expects."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


class InferenceRequest:
    """One request given to ``execute``, or one a model builds to call another model of its server (BLS:
    :meth:`exec`, :meth:`async_exec`; see :mod:`kiln.engines.python.bls`). ``preferred_memory`` is accepted and
    has no effect: outputs come back as host arrays."""

    def __init__(self, model_name: str = "", requested_output_names: Iterable[str] = (),
                 inputs: Iterable[Tensor] = (), request_id: str = "", correlation_id: int | str = 0, flags: int = 0,
                 timeout: int = 0, preferred_memory: Any = None, trace: Any = None,
                 parameters: Mapping[str, Any] | str | None = None, model_version: int = -1) -> None:
        self._model_name = model_name
        self._requested = list(requested_output_names)
        self._inputs = list(inputs)
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._flags = flags
        self._timeout = timeout
        self._parameters = parameters if isinstance(parameters, str) else json.dumps(dict(parameters or {}))
        self.model_name = model_name
        self.model_version = model_version
        self._sender: ResponseSender | None = None

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def requested_output_names(self) -> list[str]:
        return self._requested

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def timeout(self) -> int:
        return self._timeout

    def parameters(self) -> str:
        """The request's parameters as a JSON object string, as Triton gives them."""
        return self._parameters

    def is_cancelled(self) -> bool:
        """True once the client of a decoupled model's request went away (always False otherwise)."""
        return self._sender is not None and self._sender.is_cancelled()

    def exec(self, decoupled: bool = False) -> InferenceResponse | Iterator[InferenceResponse]:
        """Run this request on model ``model_name`` of the server; errors come back in the response. With
        ``decoupled=True``: an iterator over the called model's responses (the last may carry no outputs, only the
        final flag), for a decoupled model or any other."""
        if decoupled:
            return bls.call_decoupled(self)
        return bls.call(self)

    def async_exec(self, decoupled: bool = False) -> Awaitable[InferenceResponse |
                                                             AsyncIterator[InferenceResponse]]:
        """:meth:`exec` for ``async def execute``: an awaitable of the response, or with ``decoupled=True`` an
        awaitable of an async iterator over the responses."""
        if decoupled:
            return bls.call_decoupled_async(self)
        return bls.call_async(self)

    def get_response_sender(self) -> ResponseSender:
        """The sender of this request's responses (decoupled models)."""
        if self._sender is None:
            target = f"model '{self._model_name}'" if self._model_name else "this model"
            raise UnsupportedError(f"{target}: get_response_sender() is for decoupled models; set "
                                   f"model_transaction_policy {{ decoupled: true }} in config.pbtxt, or return one "
                                   f"response per request from execute")
        return self._sender

    def attach_sender(self, sender: ResponseSender) -> None:
        """Give the request its response sender (kiln's decoupled engine does, before ``execute``)."""
        self._sender = sender

    def set_release_flags(self, flags: int) -> NoReturn:
        self._unsupported("request rescheduling (InferenceRequest.set_release_flags)")

    def _unsupported(self, feature: str) -> NoReturn:
        target = f" (model '{self._model_name}')" if self._model_name else ""
        raise UnsupportedError(f"{feature}{target} is not supported by kiln's in-process Python backend; call the "
                               f"other model from the client, or compose the models in one model.py")


class InferenceResponse:
    def __init__(self, output_tensors: Iterable[Tensor] | None = None, error: TritonError | None = None,
                 parameters: Mapping[str, Any] | str | None = None) -> None:
        if output_tensors is not None and not isinstance(output_tensors, (list, tuple)):
            raise TritonModelException(f"InferenceResponse output_tensors must be a list of Tensor, got "
                                       f"{type(output_tensors).__name__}")
        self._outputs = list(output_tensors or [])
        self._error = error
        self._parameters = parameters if isinstance(parameters, str) else json.dumps(dict(parameters or {}))

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


class LogLevel(enum.IntEnum):
    INFO = logging.INFO
    WARNING = logging.WARNING
    ERROR = logging.ERROR
    VERBOSE = logging.DEBUG


class Logger:
    """Triton's model logger, on the ``kiln.python_model`` logging logger (VERBOSE is DEBUG)."""

    INFO = LogLevel.INFO
    WARNING = LogLevel.WARNING
    ERROR = LogLevel.ERROR
    VERBOSE = LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: int = LogLevel.INFO) -> None:
        _log.log(int(level), "%s", message, stacklevel=2)

    @staticmethod
    def log_info(message: str) -> None:
        _log.info("%s", message, stacklevel=2)

    @staticmethod
    def log_warn(message: str) -> None:
        _log.warning("%s", message, stacklevel=2)

    @staticmethod
    def log_error(message: str) -> None:
        _log.error("%s", message, stacklevel=2)

    @staticmethod
    def log_verbose(message: str) -> None:
        _log.debug("%s", message, stacklevel=2)


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in inference_request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in inference_response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("input", []) if t.get("name") == name), None)


def get_output_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("output", []) if t.get("name") == name), None)


def using_decoupled_model_transaction_policy(model_config: Mapping[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def triton_string_to_numpy(triton_type_string: str) -> Any:
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def triton_to_numpy_type(data_type: int) -> Any:
    """The numpy type of a Triton data type number (TRITONSERVER_DataType), None for an unknown one."""
    try:
        return triton_string_to_numpy(DataType.from_config(data_type).config_name)
    except InvalidArgumentError:  # Triton returns None for numbers it does not know
        return None


def numpy_to_triton_type(data_type: Any) -> int | None:
    try:
        return DataType.from_numpy(data_type).config_number
    except (InvalidArgumentError, TypeError):  # Triton returns None for dtypes it does not know
        return None


def serialize_byte_tensor(input_tensor: Array) -> Array | None:
    """A BYTES tensor as Triton's length-prefixed serialization (a flat uint8 array); None for other dtypes."""
    if input_tensor.size == 0:
        return np.empty(0, dtype=np.uint8)
    if input_tensor.dtype.kind not in ("O", "S"):
        return None
    return np.frombuffer(encode_bytes(input_tensor), dtype=np.uint8)


def deserialize_bytes_tensor(encoded_tensor: bytes | bytearray | memoryview | Array) -> Array:
    buffer = encoded_tensor.tobytes() if isinstance(encoded_tensor, np.ndarray) else encoded_tensor
    return decode_bytes(buffer)


__all__ = [
    "TRITONSERVER_MEMORY_CPU",
    "TRITONSERVER_MEMORY_GPU",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "TRITON_STRING_TO_NUMPY",
    "InferenceRequest",
    "InferenceResponse",
    "LogLevel",
    "Logger",
    "ModelConfig",
    "Tensor",
    "TritonError",
    "TritonModelException",
    "deserialize_bytes_tensor",
    "get_input_config_by_name",
    "get_input_tensor_by_name",
    "get_output_config_by_name",
    "get_output_tensor_by_name",
    "numpy_to_triton_type",
    "serialize_byte_tensor",
    "triton_string_to_numpy",
    "triton_to_numpy_type",
    "using_decoupled_model_transaction_policy",
]
