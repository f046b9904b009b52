"""The edge's KServe V2 HTTP endpoint: the infer, health and metadata routes of ``kiln serve`` for the one model
an :class:`~kiln.edge.EdgeRunner` holds, so a client cannot tell an edge from a server.

Bodies are decoded and encoded by kiln's HTTP codec (JSON and the binary tensor data extension). Every infer
response says where its answer came from: the response parameters ``kiln_source`` (one of
:data:`kiln.edge.runner.SOURCES`) and ``kiln_forward_reasons`` (the reasons joined by "; ", empty when the request
stayed local), ``kiln_cloud_error`` when the cloud did not answer, and the ``Kiln-Source`` header.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kiln import __version__
from kiln.edge.runner import EdgeResult, EdgeRunner
from kiln.errors import ModelNotFoundError, UnsupportedError
from kiln.tensor import DataType
from kiln.v2 import http_codec as codec
from kiln.v2.http_body import DEFAULT_MAX_INPUT_SIZE, read_body
from kiln.v2.http_responses import error_response, json_response
from kiln.v2.types import InferRequest, InferResponse, ModelMetadata, OutputTensor

SOURCE_HEADER = "Kiln-Source"
Endpoint = Callable[[Request], Awaitable[Response]]


class EdgeEndpoints:
    def __init__(self, runner: EdgeRunner, max_input_size: int) -> None:
        self.runner = runner
        self.max_input_size = max_input_size

    @property
    def metadata(self) -> ModelMetadata:
        """Read per request: model sync may have swapped in another version."""
        spec, version = self.runner.engine.spec, self.runner.version
        return ModelMetadata(name=self.runner.name, versions=[version] if version else [], platform=spec.platform,
                             inputs=list(spec.inputs), outputs=list(spec.outputs), batching=spec.batching)

    async def ready(self, request: Request) -> Response:
        return Response()

    async def server_metadata(self, request: Request) -> Response:
        return json_response({"name": "kiln-edge", "version": __version__, "extensions": ["binary_tensor_data"]})

    async def model_metadata(self, request: Request) -> Response:
        self._check_model(request)
        return json_response(codec.model_metadata_doc(self.metadata))

    async def model_ready(self, request: Request) -> Response:
        self._check_model(request)
        return Response()

    async def edge_stats(self, request: Request) -> Response:
        stats = self.runner.stats.snapshot()
        return json_response({"model": self.runner.name, "mode": self.runner.policy.mode, **stats})

    async def infer(self, request: Request) -> Response:
        name, version = self._check_model(request)
        body = await read_body(request, self.max_input_size)
        json_size = codec.header_length(request.headers.get(codec.HEADER_LENGTH), len(body))
        if json_size == 0:
            infer_request = codec.decode_raw_request(name, version, body, self.metadata)
        else:
            infer_request = codec.decode_request(name, version, body, json_size)
        inputs, outputs = _arrays(infer_request)
        result = await asyncio.to_thread(self.runner.infer, inputs, outputs)
        content, header_size = codec.encode_response(self._response(infer_request, result), infer_request)
        headers = {SOURCE_HEADER: result.source}
        if header_size is None:
            return Response(content, media_type=codec.JSON_TYPE, headers=headers)
        return Response(content, media_type=codec.BINARY_TYPE,
                        headers={**headers, codec.HEADER_LENGTH: str(header_size)})

    def _response(self, request: InferRequest, result: EdgeResult) -> InferResponse:
        outputs = [OutputTensor(name, DataType.from_numpy(array.dtype), tuple(array.shape), np.asarray(array))
                   for name, array in result.outputs.items()]
        parameters = {"kiln_source": result.source, "kiln_forward_reasons": "; ".join(result.reasons)}
        if result.cloud_error:
            parameters["kiln_cloud_error"] = result.cloud_error
        return InferResponse(model_name=self.runner.name, model_version=self.runner.version, outputs=outputs,
                             id=request.id, parameters=parameters)

    def _check_model(self, request: Request) -> tuple[str, str]:
        name = request.path_params.get("model", "")
        version = request.path_params.get("version", "")
        if name != self.runner.name or version not in ("", self.runner.version):
            which = f"'{name}'" + (f" version {version}" if version else "")
            served = f"'{self.runner.name}'" + (f" version {self.runner.version}" if self.runner.version else "")
            raise ModelNotFoundError(f"model {which} is not served by this edge (it serves {served})")
        return name, version


def _arrays(request: InferRequest) -> tuple[dict[str, Any], list[str] | None]:
    for tensor in request.inputs:
        if tensor.shared_memory is not None:
            raise UnsupportedError(f"model '{request.model_name}': input '{tensor.name}' is in shared memory; "
                                   f"the edge takes tensor data in the request body only")
    for output in request.outputs:
        if output.shared_memory is not None or output.classification:
            raise UnsupportedError(f"model '{request.model_name}': output '{output.name}' asks for shared memory "
                                   f"or classification; the edge returns plain tensors only")
    names = [output.name for output in request.outputs] or None
    return {tensor.name: tensor.data for tensor in request.inputs}, names


def build_edge_app(runner: EdgeRunner, *, max_input_size: int = DEFAULT_MAX_INPUT_SIZE) -> Starlette:
    e = EdgeEndpoints(runner, max_input_size)
    model, version = "/v2/models/{model}", "/v2/models/{model}/versions/{version}"
    table: list[tuple[str, Endpoint, str]] = [
        (model + "/infer", e.infer, "POST"),
        (version + "/infer", e.infer, "POST"),
        ("/v2/health/live", e.ready, "GET"),
        ("/v2/health/ready", e.ready, "GET"),
        ("/v2", e.server_metadata, "GET"),
        ("/v2/edge/stats", e.edge_stats, "GET"),
        (model, e.model_metadata, "GET"),
        (version, e.model_metadata, "GET"),
        (model + "/ready", e.model_ready, "GET"),
        (version + "/ready", e.model_ready, "GET"),
    ]
    return Starlette(routes=[Route(path, _guarded(handler), methods=[method]) for path, handler, method in table],
                     exception_handlers={HTTPException: _routing_error})


def _guarded(endpoint: Endpoint) -> Endpoint:
    async def guarded(request: Request) -> Response:
        try:
            return await endpoint(request)
        except Exception as exc:
            return error_response(exc)

    return guarded


async def _routing_error(request: Request, exc: Exception) -> Response:
    """Unknown paths (404) and wrong methods (405), with the ``{"error": ...}`` body every other error has."""
    assert isinstance(exc, HTTPException)
    return json_response({"error": exc.detail}, exc.status_code, exc.headers)

