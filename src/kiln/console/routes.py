"""The console's routes on the inference port: the page and its files, the status document, the OpenAPI
document and its reference page.

Why the inference port and not the metrics port: the console's actions (load, unload, A/B split, download) are
kiln's own repository and routing endpoints, called from the page with the operator's key, so every check those
endpoints make applies unchanged; a page served from another origin could not call them without CORS. Inference
requests never reach these routes: the HTTP app hands them to their endpoint before Starlette's router
(InferFirst in frontends/http/app.py), and the status document is built only while a page asks for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, Response

from kiln.console.openapi import openapi_document
from kiln.console.status import StatusSource
from kiln.errors import NotFoundError
from kiln.server.capture import CaptureStore
from kiln.server.server import Server
from kiln.v2 import http_codec as codec

STATUS_PATH = "/v2/kiln/console/status"
OPENAPI_PATH = "/v2/openapi.json"
_MEDIA = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
          ".js": "text/javascript; charset=utf-8", ".json": "application/json", ".png": "image/png",
          ".md": "text/markdown; charset=utf-8", ".csv": "text/csv; charset=utf-8"}


@dataclass(frozen=True)
class ConsoleOptions:
    """``enabled``: serve the console at all; ``downloads``: the model-download extension is on (the page offers
    the action); ``key_required``: the server has an API key (the page asks for it); ``report``: a
    `kiln bench compare` output folder the page links to."""

    enabled: bool = True
    downloads: bool = False
    key_required: bool = False
    report: Path | None = None
    captures: CaptureStore | None = None


Endpoint = Callable[[Request], Awaitable[Response]]


def console_routes(server: Server, options: ConsoleOptions,
                   gpus: Callable[[], list[dict[str, Any]]] | None = None) -> list[tuple[str, Endpoint, str]]:
    """(path, endpoint, method) of the routes to add to the HTTP app: the OpenAPI document always, the console's
    pages and status document when it is on."""
    document = codec.encode_json(openapi_document())

    async def openapi(request: Request) -> Response:
        return Response(document, media_type="application/json")

    routes: list[tuple[str, Endpoint, str]] = [(OPENAPI_PATH, openapi, "GET")]
    if not options.enabled:
        return routes
    pages = ConsolePages(server, options, gpus)
    return routes + [
        ("/console", pages.index, "GET"),
        ("/console/api", pages.reference, "GET"),
        ("/console/static/{name}", pages.static, "GET"),
        ("/console/report/{name}", pages.report, "GET"),
        (STATUS_PATH, pages.status, "GET"),
    ]


class ConsolePages:
    def __init__(self, server: Server, options: ConsoleOptions,
                 gpus: Callable[[], list[dict[str, Any]]] | None) -> None:
        self.options = options
        self.static_dir = Path(str(resources.files("kiln.console") / "static"))
        self.source = StatusSource(server, gpus=gpus, captures=options.captures, report=options.report)
        self.controls = {"model_control": server.options.control_mode, "downloads": options.downloads,
                         "key_required": options.key_required, "report": options.report is not None}

    async def index(self, request: Request) -> Response:
        return _file(self.static_dir / "index.html")

    async def reference(self, request: Request) -> Response:
        return _file(self.static_dir / "api.html")

    async def static(self, request: Request) -> Response:
        return _file(_child(self.static_dir, request.path_params["name"], "console file"))

    async def report(self, request: Request) -> Response:
        if self.options.report is None:
            raise NotFoundError("no `kiln bench compare` report was given (--console-report DIR)")
        return _file(_child(self.options.report, request.path_params["name"], "report file"))

    async def status(self, request: Request) -> Response:
        doc = await asyncio.to_thread(self.source.document)  # reads statistics under their locks, files too
        doc["controls"] = self.controls
        return Response(codec.encode_json(doc), media_type=codec.JSON_TYPE)


def _child(folder: Path, name: str, what: str) -> Path:
    """``folder/name`` for a plain file directly inside ``folder``; anything else is not found (no '..', no
    sub-folders, no hidden files)."""
    path = folder / name
    if "/" in name or name.startswith(".") or not path.is_file():
        raise NotFoundError(f"{what} '{name}' not found")
    return path


def _file(path: Path) -> Response:
    return FileResponse(path, media_type=_MEDIA.get(path.suffix, "application/octet-stream"),
                        headers={"Cache-Control": "no-cache"})
