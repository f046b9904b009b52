"""A repository split into one application per model (``kiln cluster serve --deployment-per-model``), for
repositories larger than one replica should hold.

Each model gets a Serve application of its own whose route prefix is the model's V2 path (``/v2/models/NAME``
below the cluster's prefix): Serve's ingress sends a request for that model straight to a replica holding it
(HAProxy matches the longest prefix), no router replica in between. Its replicas load only that model and the
models its ensemble steps call, and ask Ray for that model's GPUs. A front application at the cluster's prefix
holds no model and answers the server-wide routes (health, server metadata, repository index, all-model statistics,
metrics) for the whole cluster: every replica of every application reports to the front's statistics board. Python
models that call other models (BLS) reach only the models of their own application."""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from kiln.cluster.metrics import request_path
from kiln.cluster.stats import Document, answer_rewritten
from kiln.errors import InvalidArgumentError, ModelNotReadyError
from kiln.frontends.http.endpoints import NOT_READY
from kiln.v2.status import error_body

_MODEL_PREFIX = re.compile(r"^(?P<base>.*)/v2/models/[^/]+$")
_ROUTABLE = re.compile(r"[A-Za-z0-9._-]+")
log = logging.getLogger("kiln.cluster")


def model_route_prefix(base: str, model: str) -> str:
    """The route prefix of ``model``'s application below the cluster's prefix ``base``."""
    return f"{base.rstrip('/')}/v2/models/{model}"


@dataclass(frozen=True)
class ModelApplication:
    name: str
    route_prefix: str
    model: str


def model_applications(front: str, base: str, models: list[str]) -> list[ModelApplication]:
    for model in models:  # a route prefix goes unquoted into HAProxy's config and Serve's route table
        if not _ROUTABLE.fullmatch(model):
            raise InvalidArgumentError(f"model '{model}' cannot have an application of its own: its name goes into "
                                       f"a route prefix, which takes letters, digits, '.', '_' and '-' only")
    return [ModelApplication(f"{front}-{model}", model_route_prefix(base, model), model) for model in models]


class BelowModelPrefix:
    """Serve puts an application's route prefix in ``root_path``; a model's application is mounted at the model's
    own V2 path, and kiln's app routes the full path below the cluster's prefix, so the model part goes back."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = _MODEL_PREFIX.match(scope.get("root_path", ""))
        if match is not None:
            scope = {**scope, "root_path": match["base"]}
        await self.app(scope, receive, send)


class ClusterFront:
    """The front's server-wide answers from the whole cluster (the front holds no model). Readiness: the front's
    own, and every model of the repository as the front found it at start served by some replica. Repository index:
    the front's own answer (which also gives kiln serve's errors for a bad body) with a READY entry for every
    version some replica serves. Both read what the statistics board heard from the replicas in the last seconds;
    with the board unreachable, the front answers as a server holding no model."""

    def __init__(self, app: ASGIApp, served: Callable[[], Awaitable[Document]], expected: set[str]) -> None:
        self.app = app
        self._served = served  # the board's summed statistics document
        self._expected = expected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = request_path(scope) if scope["type"] == "http" else ""
        if path == "/v2/health/ready" and scope["method"] == "GET":
            await self._ready(scope, receive, send)
        elif path == "/v2/repository/index" and scope["method"] == "POST":
            await answer_rewritten(self.app, scope, receive, send, self._merged)
        else:
            await self.app(scope, receive, send)

    async def _ready(self, scope: Scope, receive: Receive, send: Send) -> None:
        served = await self._served_or_none()
        missing = sorted(self._expected - {e["name"] for e in served or []})
        if served is None or not missing:
            await self.app(scope, receive, send)
            return
        body = orjson.dumps(error_body(ModelNotReadyError(
            f"cluster is not ready: no replica serves {', '.join(missing)} yet")))
        await send({"type": "http.response.start", "status": int(NOT_READY),
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _merged(self, body: bytes) -> bytes:
        served = await self._served_or_none()
        return body if served is None else orjson.dumps(merged_index(orjson.loads(body), served))

    async def _served_or_none(self) -> Document | None:
        try:
            return await self._served()
        except Exception:  # the board restarting
            log.warning("statistics board unreachable; the front answers for itself", exc_info=True)
            return None


def merged_index(own: list[dict[str, str]], served: Document) -> list[dict[str, str]]:
    entries = {(e["name"], e.get("version", "")): e for e in own}
    for entry in served:
        key = (entry["name"], entry["version"])
        entries[key] = {"name": key[0], "version": key[1], "state": "READY", "reason": ""}
    return [entries[key] for key in sorted(entries)]
