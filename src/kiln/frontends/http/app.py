"""The KServe V2 / Triton HTTP application: the route table and the error handlers, nothing else."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kiln.console import ConsoleOptions, console_routes
from kiln.console.gpus import GpuReader
from kiln.frontends.access import AccessPolicy
from kiln.frontends.http.auth import restricted
from kiln.frontends.http.capture import CaptureEndpoints, CaptureOptions
from kiln.frontends.http.endpoints import Endpoints
from kiln.frontends.http.files import DownloadOptions, FileEndpoints
from kiln.frontends.http.generate import GenerateEndpoints
from kiln.frontends.http.routing import RoutingEndpoints
from kiln.server.server import Server
from kiln.v2.http_body import DEFAULT_MAX_INPUT_SIZE
from kiln.v2.http_responses import error_response

Endpoint = Callable[[Request], Awaitable[Response]]


_MODEL = "/v2/models/{model}"
_VERSION = "/v2/models/{model}/versions/{version}"
_SYSTEM_SHM = "/v2/systemsharedmemory"
_CUDA_SHM = "/v2/cudasharedmemory"


def build_app(server: Server, *, max_input_size: int = DEFAULT_MAX_INPUT_SIZE,
              downloads: DownloadOptions | None = None, capture: CaptureOptions | None = None,
              access: AccessPolicy | None = None, console: ConsoleOptions | None = None) -> ASGIApp:
    """An ASGI app serving ``server`` over HTTP; request bodies larger than ``max_input_size`` bytes get 400.
    ``downloads`` configures the model-file extension, ``capture`` the sample-capture one (both off by default,
    see files.py and capture.py); ``access`` restricts API groups (--http-restricted-api, auth.py); ``console`` the
    browser console and the OpenAPI document (kiln/console/)."""
    endpoints = Endpoints(server, max_input_size)
    files = FileEndpoints(server, downloads or DownloadOptions())
    captures = CaptureEndpoints(server, capture or CaptureOptions(), max_input_size)
    routing = RoutingEndpoints(server, max_input_size)
    generate = GenerateEndpoints(server, max_input_size)
    pages = console_routes(server, console or ConsoleOptions(), GpuReader())
    app = Starlette(routes=_routes(endpoints, files, captures) + _routing_routes(routing) + _generate_routes(generate)
                    + [Route(path, _guarded(handler), methods=[method]) for path, handler, method in pages],
                    exception_handlers={HTTPException: _http_error, Exception: _unexpected})
    return restricted(InferFirst(app, _guarded(endpoints.infer)), access)


class InferFirst:
    """Inference requests go straight to their endpoint; everything else through Starlette. Starlette's middleware
    and router cost about 10-15 us a request, a tenth of a small model's whole request on the event loop. The
    endpoint is the same guarded one the route table holds, so answers and errors do not change."""

    def __init__(self, app: Starlette, infer: Endpoint) -> None:
        self.app = app
        self._infer = infer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        params = _infer_params(scope) if scope["type"] == "http" and scope["method"] == "POST" else None
        if params is None:
            await self.app(scope, receive, send)
            return
        scope["app"] = self.app
        scope["path_params"] = params
        response = await self._infer(Request(scope, receive))
        await response(scope, receive, send)


def _infer_params(scope: Scope) -> dict[str, str] | None:
    """``model`` (and ``version``) of ``/v2/models/{model}[/versions/{version}]/infer``, None for other paths,
    matched as the route table's patterns match them (a path segment is anything but '/', and not empty)."""
    parts = scope["path"].split("/")
    if len(parts) == 5 and parts[:3] == ["", "v2", "models"] and parts[4] == "infer" and parts[3]:
        return {"model": parts[3]}
    if len(parts) == 7 and parts[:3] == ["", "v2", "models"] and parts[4] == "versions" and parts[6] == "infer" \
            and parts[3] and parts[5]:
        return {"model": parts[3], "version": parts[5]}
    return None


def _routes(e: Endpoints, f: FileEndpoints, c: CaptureEndpoints) -> list[BaseRoute]:
    table: list[tuple[str, Endpoint, str]] = [
        # Inference first: the router tries routes in order.
        (_MODEL + "/infer", e.infer, "POST"),
        (_VERSION + "/infer", e.infer, "POST"),
        ("/v2/health/live", e.live, "GET"),
        ("/v2/health/ready", e.ready, "GET"),
        ("/v2", e.server_metadata, "GET"),
        ("/v2/models/stats", e.model_statistics, "GET"),  # before /v2/models/{model}
        (_MODEL, e.model_metadata, "GET"),
        (_VERSION, e.model_metadata, "GET"),
        (_MODEL + "/ready", e.model_ready, "GET"),
        (_VERSION + "/ready", e.model_ready, "GET"),
        (_MODEL + "/config", e.model_config, "GET"),
        (_VERSION + "/config", e.model_config, "GET"),
        (_MODEL + "/stats", e.model_statistics, "GET"),
        (_VERSION + "/stats", e.model_statistics, "GET"),
        ("/v2/repository/index", e.repository_index, "POST"),
        ("/v2/repository/{repository}/index", e.repository_index, "POST"),
        ("/v2/repository/models/{model}/load", e.load_model, "POST"),
        ("/v2/repository/models/{model}/unload", e.unload_model, "POST"),
        ("/v2/kiln/models/{model}/versions/{version}/files", f.list_files, "GET"),
        ("/v2/kiln/models/{model}/versions/{version}/files/{path:path}", f.download, "GET"),
        ("/v2/kiln/models/{model}/versions/{version}/capture", c.capture, "POST"),
    ]
    table += [
        (_SYSTEM_SHM + "/status", e.system_shared_memory_status, "GET"),
        (_SYSTEM_SHM + "/region/{region}/status", e.system_shared_memory_status, "GET"),
        (_SYSTEM_SHM + "/region/{region}/register", e.system_shared_memory_register, "POST"),
        (_SYSTEM_SHM + "/unregister", e.system_shared_memory_unregister, "POST"),
        (_SYSTEM_SHM + "/region/{region}/unregister", e.system_shared_memory_unregister, "POST"),
        (_CUDA_SHM + "/status", e.cuda_shared_memory_status, "GET"),
        (_CUDA_SHM + "/region/{region}/status", e.cuda_shared_memory_status, "GET"),
        (_CUDA_SHM + "/region/{region}/register", e.cuda_shared_memory_register, "POST"),
        (_CUDA_SHM + "/unregister", e.cuda_shared_memory_unregister, "POST"),
        (_CUDA_SHM + "/region/{region}/unregister", e.cuda_shared_memory_unregister, "POST"),
    ]
    return [Route(path, _guarded(handler), methods=[method]) for path, handler, method in table]


def _routing_routes(r: RoutingEndpoints) -> list[BaseRoute]:
    path = "/v2/repository/models/{model}/kiln/routing"
    return [Route(path, _guarded(r.status), methods=["GET"]), Route(path, _guarded(r.update), methods=["POST"])]


def _generate_routes(g: GenerateEndpoints) -> list[BaseRoute]:
    """Triton's generate extension (generate.py)."""
    return [Route(base + suffix, _guarded(handler), methods=["POST"]) for base in (_MODEL, _VERSION)
            for suffix, handler in (("/generate", g.generate), ("/generate_stream", g.generate_stream))]


def _guarded(endpoint: Endpoint) -> Endpoint:
    """Answer every exception an endpoint raises with its error response, so none reaches Starlette's
    ServerErrorMiddleware (which would re-raise it to the ASGI server after answering)."""

    async def guarded(request: Request) -> Response:
        try:
            return await endpoint(request)
        except Exception as exc:
            return error_response(exc)

    guarded.__name__ = getattr(endpoint, "__name__", "endpoint")
    return guarded


async def _http_error(request: Request, exc: Exception) -> Response:
    """Routing errors: unmatched path (404 Not Found) and wrong method (405 Method Not Allowed)."""
    assert isinstance(exc, HTTPException)
    return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)


async def _unexpected(request: Request, exc: Exception) -> Response:
    """Last resort for a failure outside any endpoint (Starlette answers it in ServerErrorMiddleware)."""
    return error_response(exc)
