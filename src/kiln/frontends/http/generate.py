"""Triton's generate extension: ``POST /v2/models/{m}[/versions/{v}]/generate`` and ``.../generate_stream``.

The body is one JSON object. A field named like one of the model's inputs becomes that input, with the input's
data type (strings for BYTES inputs): a scalar as a tensor of one element, a list as a tensor of its shape; with
batching, a batch dimension of 1 comes first. ``parameters`` (an object of strings, numbers and booleans) and every
other field whose value is a string, number or boolean become request parameters (``id``, when the model has no
such input, is the request id); any other value is refused. In an answer, each output is a field: a single element
as a scalar, more as a flat list (BYTES as strings), beside ``model_name`` and ``model_version``.

``/generate`` answers one JSON document and needs exactly one response from the model; a decoupled model that sends
none or several is refused, in Triton's words. ``/generate_stream`` sends each response as a server-sent event
(``data: {...}`` and a blank line) as the model sends it; an error while streaming is an event ``{"error": ...}``.
A request that fails before the model runs is answered with a JSON error and its status, as every endpoint does;
when the model's first response is an error, the stream carries that error's status.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import numpy as np
import numpy.typing as npt
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kiln.errors import InvalidArgumentError
from kiln.server.server import Server, StreamItem
from kiln.tensor import DataType
from kiln.v2.http_body import parse_json, read_body
from kiln.v2.http_codec import encode_json, short_json
from kiln.v2.http_responses import json_response
from kiln.v2.status import as_kiln_error, http_status
from kiln.v2.types import InferRequest, InferResponse, InputTensor, ModelMetadata

EVENT_STREAM = "text/event-stream"  # Starlette adds "; charset=utf-8", as Triton's header has it
NOT_ONE_RESPONSE = ("generate expects model to produce exactly 1 response, use generate stream for model that "
                    "generates various number of responses")
_SCALAR = (str, int, float, bool)


class GenerateEndpoints:
    def __init__(self, server: Server, max_input_size: int) -> None:
        self.server = server
        self.max_input_size = max_input_size

    async def generate(self, request: Request) -> Response:
        infer_request = await self._decode(request)
        answers: list[InferResponse] = []
        async with contextlib.aclosing(self.server.infer_stream(infer_request)) as items:
            async for item in items:
                if item.error is not None:
                    raise item.error
                if item.response is not None:
                    answers.append(item.response)
                    if len(answers) > 1:
                        break
        if len(answers) != 1:
            raise InvalidArgumentError(NOT_ONE_RESPONSE)
        return json_response(answer_doc(answers[0]))

    async def generate_stream(self, request: Request) -> Response:
        items = self.server.infer_stream(await self._decode(request))
        try:
            first: StreamItem | None = await anext(items)
        except StopAsyncIteration:
            first = None
        except BaseException:
            await items.aclose()
            raise  # the request did not run: a JSON error from the endpoint guard
        status = 200 if first is None or first.error is None else http_status(as_kiln_error(first.error))
        return StreamingResponse(_events(first, items), status_code=status, media_type=EVENT_STREAM)

    async def _decode(self, request: Request) -> InferRequest:
        name, version = request.path_params["model"], request.path_params.get("version", "")
        doc = parse_json(await read_body(request, self.max_input_size), "generate request")
        return generate_request(name, version, doc, self.server.model_metadata(name, version))


def generate_request(model: str, version: str, doc: object, metadata: ModelMetadata) -> InferRequest:
    """The inference request a generate body stands for (see the module docstring)."""
    if not isinstance(doc, dict):
        raise InvalidArgumentError(f"generate request for model '{model}': the body must be a JSON object of input "
                                   f"names and parameters; got {short_json(doc)}")
    inputs_by_name = {t.name: t for t in metadata.inputs}
    inputs: list[InputTensor] = []
    parameters: dict[str, str | int | float | bool] = {}
    request_id = ""
    for key, value in doc.items():
        tensor = inputs_by_name.get(key)
        if tensor is not None:
            inputs.append(_input(model, key, tensor.datatype, value, metadata.batching))
        elif key == "parameters":
            parameters.update(_parameters(model, value))
        elif key == "id" and isinstance(value, str):
            request_id = value
        else:
            parameters[key] = _parameter(model, key, value)
    return InferRequest(model_name=model, model_version=version, inputs=inputs, id=request_id,
                        parameters=parameters)


def _input(model: str, name: str, datatype: DataType, value: object, batching: bool) -> InputTensor:
    where = f"generate request for model '{model}': input '{name}' ({datatype.wire_name})"
    try:
        raw = np.array(value, dtype=object)
    except ValueError:
        raise InvalidArgumentError(f"{where}: {short_json(value)} is not a scalar or a list of even shape") from None
    if raw.dtype != object or any(not _fits(datatype, v) for v in raw.reshape(-1)):
        kinds = "strings" if datatype is DataType.BYTES else "booleans" if datatype is DataType.BOOL else \
            "integers" if datatype.numpy_dtype.kind in "iu" else "numbers"
        raise InvalidArgumentError(f"{where} takes {kinds} (a scalar or a list); got {short_json(value)}")
    shape = raw.shape or (1,)
    if datatype is DataType.BYTES:
        data: npt.NDArray[Any] = np.empty(raw.size, dtype=object)
        data[:] = [v.encode("utf-8") for v in raw.reshape(-1)]
    else:
        data = raw.astype(datatype.numpy_dtype)
    shape = (1, *shape) if batching else shape
    return InputTensor(name, datatype, shape, data.reshape(shape))


def _fits(datatype: DataType, value: object) -> bool:
    if datatype is DataType.BYTES:
        return isinstance(value, str)
    if datatype is DataType.BOOL:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if datatype.numpy_dtype.kind in "iu" else isinstance(value, (int, float))


def _parameters(model: str, value: object) -> dict[str, str | int | float | bool]:
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"generate request for model '{model}': 'parameters' must be an object of "
                                   f"names to strings, numbers or booleans; got {short_json(value)}")
    return {key: _parameter(model, key, item) for key, item in value.items()}


def _parameter(model: str, key: str, value: object) -> str | int | float | bool:
    if not isinstance(value, _SCALAR):
        raise InvalidArgumentError(f"generate request for model '{model}': parameter '{key}' has invalid type "
                                   f"({short_json(value)}); a field that is not an input of the model is a "
                                   f"parameter: a string, number or boolean")
    return value


def answer_doc(response: InferResponse) -> dict[str, Any]:
    """A response as a generate answer: ``model_name``, ``model_version`` (``id``) and one field per output."""
    doc: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        doc["id"] = response.id
    for output in response.outputs:
        doc[output.name] = _json_value(output.datatype, output.data)
    return doc


def _json_value(datatype: DataType, data: npt.NDArray[Any]) -> Any:
    flat = data.reshape(-1)
    if datatype is DataType.BYTES:
        values: list[Any] = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in flat.tolist()]
    else:
        values = (flat.astype(np.float32) if datatype is DataType.BF16 else flat).tolist()
    return values[0] if len(values) == 1 else values


async def _events(first: StreamItem | None, rest: AsyncGenerator[StreamItem, None]) -> AsyncIterator[bytes]:
    """Each response as a server-sent event; a final flag alone sends nothing."""
    try:
        if first is not None:
            for event in _event(first):
                yield event
        async for item in rest:
            for event in _event(item):
                yield event
    finally:
        await rest.aclose()  # the model learns that the client left


def _event(item: StreamItem) -> list[bytes]:
    if item.error is not None:
        return [b"data: " + encode_json({"error": as_kiln_error(item.error).message}) + b"\n\n"]
    if item.response is not None:
        return [b"data: " + encode_json(answer_doc(item.response)) + b"\n\n"]
    return []
