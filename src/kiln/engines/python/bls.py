"""Business logic scripting: a Python model calling the other models of its server from ``execute``
(``pb_utils.InferenceRequest(...).exec()`` and ``await ...async_exec()``), as Triton's Python backend allows.
With ``decoupled=True`` a call gives the called model's responses one by one as they come (an iterator, or for
``async_exec`` an async iterator); the last may carry only the final flag and no outputs.

The engine names the server for the duration of each ``execute`` (a context variable, so an ``async def
execute`` and the threads it starts see it too); a call runs the request through the server's request path
(``Server.infer_sync``: routing, validation, the called model's scheduler) on the calling thread. As on Triton,
a failed call is not raised: it comes back as a response whose ``has_error()`` is true. A model loaded alone
(``kiln.load``) has no server to call.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

from kiln.engines.base import ModelCaller
from kiln.errors import ErrorCode, KilnError, UnsupportedError
from kiln.tensor import DataType
from kiln.v2.types import InferRequest, InferResponse, InputTensor, RequestedOutput

if TYPE_CHECKING:
    from kiln.engines.python.compat import InferenceRequest, InferenceResponse



class StreamCaller(Protocol):
    """A server's streaming request path (``kiln.Server.infer_stream_sync``): items with ``response``, ``error``
    and ``final``."""

    def infer_stream_sync(self, request: InferRequest) -> Iterator[Any]: ...


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


def call(request: InferenceRequest) -> InferenceResponse:
    return _run(_caller(request), request)


def call_async(request: InferenceRequest) -> asyncio.Future[InferenceResponse]:
    """An awaitable of the call, run on a worker thread of the running event loop (``async def execute``)."""
    caller = _caller(request)
    return asyncio.get_running_loop().run_in_executor(None, _run, caller, request)


def call_decoupled(request: InferenceRequest) -> Iterator[InferenceResponse]:
    """The called model's responses as they come; a failure is one response with the error, and the end."""
    return _start_stream(cast(StreamCaller, _caller(request)), request)


async def call_decoupled_async(request: InferenceRequest) -> AsyncIterator[InferenceResponse]:
    """:func:`call_decoupled` for ``async def execute``: the call and each response are awaited on worker
    threads, so the event loop runs on meanwhile."""
    caller = cast(StreamCaller, _caller(request))  # read here: executor threads do not see the context variable
    loop = asyncio.get_running_loop()
    responses = await loop.run_in_executor(None, _start_stream, caller, request)
    return _pull_async(responses)


def _start_stream(caller: StreamCaller, request: InferenceRequest) -> Iterator[InferenceResponse]:
    """Send the request now (as Triton does) and give an iterator over its responses."""
    try:
        items = caller.infer_stream_sync(_as_v2(request))
    except KilnError as exc:
        return iter([_failed(exc)])
    return _responses(items)


def _responses(items: Iterator[Any]) -> Iterator[InferenceResponse]:
    from kiln.engines.python.compat import InferenceResponse

    try:
        for item in items:
            if item.error is not None:
                yield _failed(item.error)
            elif item.response is not None:
                yield _answer(item.response)
            else:
                yield InferenceResponse()  # the final flag alone
    except KilnError as exc:
        yield _failed(exc)


async def _pull_async(responses: Iterator[InferenceResponse]) -> AsyncIterator[InferenceResponse]:
    loop = asyncio.get_running_loop()
    done = object()
    while (item := await loop.run_in_executor(None, next, responses, done)) is not done:
        yield cast("InferenceResponse", item)


def _caller(request: InferenceRequest) -> ModelCaller:
    caller = _CALLER.get()
    if caller is None:
        raise UnsupportedError(f"calling model '{request.model_name}' from execute (BLS) needs a kiln server; a "
                               f"model loaded alone with kiln.load cannot reach other models")
    return caller


def _run(caller: ModelCaller, request: InferenceRequest) -> InferenceResponse:
    try:
        return _answer(caller.infer_sync(_as_v2(request)))
    except KilnError as exc:
        return _failed(exc)


def _answer(response: InferResponse) -> InferenceResponse:
    from kiln.engines.python.compat import InferenceResponse, Tensor

    return InferenceResponse([Tensor(output.name, output.data) for output in response.outputs],
                             parameters=dict(response.parameters))


def _failed(error: KilnError) -> InferenceResponse:
    from kiln.engines.python.compat import InferenceResponse, TritonError

    return InferenceResponse(error=TritonError(error.message, _TRITON_CODES.get(error.code, 0)))


def _as_v2(request: InferenceRequest) -> InferRequest:
    inputs = []
    for tensor in request.inputs():
        array = np.asarray(tensor.as_numpy())
        inputs.append(InputTensor(tensor.name(), DataType.from_numpy(array.dtype), tuple(array.shape), array))
    version = request.model_version
    return InferRequest(model_name=request.model_name, inputs=inputs, model_version=str(version) if version > 0 else "",
                        id=request.request_id(), outputs=[RequestedOutput(n) for n in request.requested_output_names()])
