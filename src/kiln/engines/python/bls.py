"""Business logic scripting: a Python model calling the other models of its server from ``execute``
(``pb_utils.InferenceRequest(...).exec()`` and ``await ...async_exec()``), as Triton's Python backend allows.

The engine names the server for the duration of each ``execute`` (a context variable, so an ``async def
execute`` and the threads it starts see it too); a call runs the request through the server's request path
(``Server.infer_sync``: routing, validation, the called model's scheduler) on the calling thread. As on Triton,
a failed call is not raised: it comes back as a response whose ``has_error()`` is true. A model loaded alone
(``kiln.load``) has no server to call.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from kiln.engines.base import ModelCaller
from kiln.errors import ErrorCode, KilnError, UnsupportedError
from kiln.tensor import DataType
from kiln.v2.types import InferRequest, InputTensor, RequestedOutput

if TYPE_CHECKING:
    from kiln.engines.python.compat import InferenceRequest, InferenceResponse

_CALLER: contextvars.ContextVar[ModelCaller | None] = contextvars.ContextVar("kiln_bls_caller", default=None)

# kiln's error codes as pb_utils.TritonError codes (UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE,
# UNSUPPORTED, ALREADY_EXISTS, CANCELLED); access-control codes have no Triton counterpart: UNKNOWN.
_TRITON_CODES = {ErrorCode.INTERNAL: 1, ErrorCode.NOT_FOUND: 2, ErrorCode.INVALID_ARG: 3, ErrorCode.UNAVAILABLE: 4,
                 ErrorCode.UNSUPPORTED: 5, ErrorCode.ALREADY_EXISTS: 6, ErrorCode.CANCELLED: 7}


@contextmanager
def calls_through(caller: ModelCaller | None) -> Iterator[None]:
    """BLS calls made while the block runs go to ``caller``."""
    token = _CALLER.set(caller)
    try:
        yield
    finally:
        _CALLER.reset(token)


def call(request: InferenceRequest, decoupled: bool = False) -> InferenceResponse:
    return _run(_caller(request, decoupled), request)


def call_async(request: InferenceRequest, decoupled: bool = False) -> asyncio.Future[InferenceResponse]:
    """An awaitable of the call, run on a worker thread of the running event loop (``async def execute``)."""
    caller = _caller(request, decoupled)
    return asyncio.get_running_loop().run_in_executor(None, _run, caller, request)


def _caller(request: InferenceRequest, decoupled: bool) -> ModelCaller:
    if decoupled:
        raise UnsupportedError(f"calling model '{request.model_name}' with decoupled=True: kiln has no decoupled "
                               f"models yet; call it with decoupled=False")
    caller = _CALLER.get()
    if caller is None:
        raise UnsupportedError(f"calling model '{request.model_name}' from execute (BLS) needs a kiln server; a "
                               f"model loaded alone with kiln.load cannot reach other models")
    return caller


def _run(caller: ModelCaller, request: InferenceRequest) -> InferenceResponse:
    from kiln.engines.python.compat import InferenceResponse, Tensor, TritonError

    try:
        response = caller.infer_sync(_as_v2(request))
    except KilnError as exc:
        return InferenceResponse(error=TritonError(exc.message, _TRITON_CODES.get(exc.code, 0)))
    return InferenceResponse([Tensor(output.name, output.data) for output in response.outputs],
                             parameters=dict(response.parameters))


def _as_v2(request: InferenceRequest) -> InferRequest:
    inputs = []
    for tensor in request.inputs():
        array = np.asarray(tensor.as_numpy())
        inputs.append(InputTensor(tensor.name(), DataType.from_numpy(array.dtype), tuple(array.shape), array))
    version = request.model_version
    return InferRequest(model_name=request.model_name, inputs=inputs, model_version=str(version) if version > 0 else "",
                        id=request.request_id(), outputs=[RequestedOutput(n) for n in request.requested_output_names()])
