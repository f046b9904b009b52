"""One short async function per KServe V2 / Triton HTTP route: read the request, call the Server, encode.

Errors are raised, never rendered here: the guard that ``app.py`` puts around every endpoint turns them into
``{"error": message}`` with the status from ``kiln.v2.status``.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

from starlette.requests import Request
from starlette.responses import Response

from kiln.config.render import config_to_json
from kiln.errors import InvalidArgumentError, ModelNotReadyError, UnsupportedError
from kiln.frontends.http import documents
from kiln.frontends.http.routing import ROUTING_KEY_HEADER, apply_routing_key
from kiln.server.server import DecoupledModelError, Server
from kiln.v2 import http_codec as codec
from kiln.v2.http_body import read_body
from kiln.v2.http_codec import decode_or_not_found
from kiln.v2.http_responses import json_response
from kiln.v2.status import error_body
from kiln.v2.types import InferRequest, InferResponse

NOT_READY = HTTPStatus.BAD_REQUEST
"""KServe's answer to a health or model-readiness probe that fails. Not an error mapping: the protocol fixes it
(Triton's ``EVHTP_RES_BADREQ`` in ``HandleServerHealth`` / ``HandleModelReady``)."""


def _not_ready(message: str) -> Response:
    return json_response(error_body(ModelNotReadyError(message)), NOT_READY)


class Endpoints:
    """The route handlers, bound to one Server and the request body limit."""

    def __init__(self, server: Server, max_input_size: int) -> None:
        self.server = server
        self.max_input_size = max_input_size

    # -- health and metadata ---------------------------------------------------------------------------------

    async def live(self, request: Request) -> Response:
        return Response() if self.server.live() else _not_ready("server is not live")

    async def ready(self, request: Request) -> Response:
        return Response() if self.server.ready() else _not_ready("server is not ready")

    async def server_metadata(self, request: Request) -> Response:
        return json_response(self.server.metadata())

    async def model_metadata(self, request: Request) -> Response:
        name, version = _model(request)
        return json_response(codec.model_metadata_doc(self.server.model_metadata(name, version)))

    async def model_ready(self, request: Request) -> Response:
        name, version = _model(request)
        if self.server.model_ready(name, version):
            return Response()
        which = f"model '{name}'" + (f" version {version}" if version else "")
        return _not_ready(f"{which} is not ready")

    async def model_config(self, request: Request) -> Response:
        name, version = _model(request)
        return json_response(config_to_json(self.server.model_config(name, version)))

    async def model_statistics(self, request: Request) -> Response:
        name, version = _model(request)
        return json_response(documents.statistics_doc(self.server.model_statistics(name, version)))

    # -- inference -------------------------------------------------------------------------------------------

    async def infer(self, request: Request) -> Response:
        name, version = _model(request)
        try:
            body = await read_body(request, self.max_input_size)
        except InvalidArgumentError:
            self.server.model_metadata(name, version)  # an unknown model is NOT_FOUND before its body's size
            raise
        json_size = codec.header_length(request.headers.get(codec.HEADER_LENGTH), len(body))
        if json_size == 0:
            metadata = self.server.model_metadata(name, version)
            infer_request = codec.decode_raw_request(name, version, body, metadata)
        else:
            infer_request = decode_or_not_found(self.server.model_metadata, name, version, body, json_size)
        apply_routing_key(self.server, request.headers.get(ROUTING_KEY_HEADER), infer_request)
        return render(await infer_over_http(self.server, infer_request), infer_request)

    # -- repository ------------------------------------------------------------------------------------------

    async def repository_index(self, request: Request) -> Response:
        ready_only = documents.index_ready_only(await read_body(request, self.max_input_size))
        return json_response(documents.index_doc(self.server.repository_index(ready_only)))

    async def load_model(self, request: Request) -> Response:
        name = request.path_params["model"]
        control = documents.control_request(await read_body(request, self.max_input_size), "load", name)
        await asyncio.to_thread(self.server.load_model, name, control.config, control.files)
        return Response()

    async def unload_model(self, request: Request) -> Response:
        name = request.path_params["model"]
        control = documents.control_request(await read_body(request, self.max_input_size), "unload", name)
        await asyncio.to_thread(self.server.unload_model, name, control.unload_dependents)
        return Response()

    # -- shared memory ---------------------------------------------------------------------------------------

    async def system_shared_memory_status(self, request: Request) -> Response:
        regions = self.server.system_shared_memory_status(request.path_params.get("region", ""))
        return json_response(documents.shm_status_doc(regions))

    async def system_shared_memory_register(self, request: Request) -> Response:
        name = request.path_params["region"]
        self.server.check_client_shm()  # a disabled server refuses before looking at the body
        key, offset, byte_size = documents.shm_register_request(await read_body(request, self.max_input_size), name)
        self.server.register_system_shared_memory(name, key, offset, byte_size)
        return Response()

    async def system_shared_memory_unregister(self, request: Request) -> Response:
        await asyncio.to_thread(self.server.unregister_system_shared_memory, request.path_params.get("region", ""))
        return Response()

    async def cuda_shared_memory_status(self, request: Request) -> Response:
        regions = self.server.cuda_shared_memory_status(request.path_params.get("region", ""))
        return json_response(documents.cuda_shm_status_doc(regions))

    async def cuda_shared_memory_register(self, request: Request) -> Response:
        name = request.path_params["region"]
        self.server.check_cuda_shm()  # a server that cannot serve it refuses before looking at the body
        raw_handle, device_id, byte_size = documents.cuda_shm_register_request(
            await read_body(request, self.max_input_size), name)
        await asyncio.to_thread(self.server.register_cuda_shared_memory, name, raw_handle, device_id, byte_size)
        return Response()

    async def cuda_shared_memory_unregister(self, request: Request) -> Response:
        await asyncio.to_thread(self.server.unregister_cuda_shared_memory, request.path_params.get("region", ""))
        return Response()


def _model(request: Request) -> tuple[str, str]:
    params = request.path_params
    return params.get("model", ""), params.get("version", "")


async def infer_over_http(server: Server, request: InferRequest) -> InferResponse:
    """``server``'s answer to an HTTP infer request; a decoupled model's refusal in Triton's words (its
    generate_stream route serves such models)."""
    try:
        return await server.infer(request)
    except DecoupledModelError:
        raise UnsupportedError("HTTP end point doesn't support models with decoupled transaction policy") from None


def render(answer: InferResponse, request: InferRequest) -> Response:
    """The response to ``request``: ``answer`` encoded, with the binary extension where the request asks for it."""
    content, header_size = codec.encode_response(answer, request)
    if header_size is None:
        return Response(content, media_type=codec.JSON_TYPE)
    return Response(content, media_type=codec.BINARY_TYPE, headers={codec.HEADER_LENGTH: str(header_size)})
