"""A repository split into one application per model (``kiln cluster serve --deployment-per-model``), for
repositories larger than one replica should hold.

Each model gets a Serve application of its own whose route prefix is the model's V2 path (``/v2/models/NAME``
below the cluster's prefix): Serve's ingress sends a request for that model straight to a replica holding it
(HAProxy matches the longest prefix), no router replica in between. Its replicas load only that model and the
models its ensemble steps call, and ask Ray for that model's GPUs. A front application at the cluster's prefix
holds no model and answers the server-wide routes (health, server metadata, repository index, all-model statistics,
metrics); every replica of every application reports to the front's statistics board, so sums and metrics cover
the whole cluster."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from kiln.cluster.metrics import request_path
from kiln.cluster.stats import Document, answer_rewritten

_MODEL_PREFIX = re.compile(r"^(?P<base>.*)/v2/models/[^/]+$")


def model_route_prefix(base: str, model: str) -> str:
    """The route prefix of ``model``'s application below the cluster's prefix ``base``."""
    return f"{base.rstrip('/')}/v2/models/{model}"


@dataclass(frozen=True)
class ModelApplication:
    name: str
    route_prefix: str
    model: str


def model_applications(front: str, base: str, models: list[str]) -> list[ModelApplication]:
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


class ClusterIndex:
    """The front's repository index: the front holds no model, so its own answer (which also gives kiln serve's
    errors for a bad body) gets a READY entry for every version that some replica in the cluster serves (the
    versions the statistics board heard of)."""

    def __init__(self, app: ASGIApp, served: Any) -> None:
        self.app = app
        self._served = served  # async () -> the board's summed statistics document

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or request_path(scope) != "/v2/repository/index":
            await self.app(scope, receive, send)
            return
        await answer_rewritten(self.app, scope, receive, send, self._merged)

    async def _merged(self, body: bytes) -> bytes:
        return orjson.dumps(merged_index(orjson.loads(body), await self._served()))


def merged_index(own: list[dict[str, str]], served: Document) -> list[dict[str, str]]:
    entries = {(e["name"], e.get("version", "")): e for e in own}
    for entry in served:
        key = (entry["name"], entry["version"])
        entries[key] = {"name": key[0], "version": key[1], "state": "READY", "reason": ""}
    return [entries[key] for key in sorted(entries)]
