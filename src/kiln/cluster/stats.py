"""Statistics summed across replicas. Every replica holds its own kiln.Server and so its own counts; a client asking
the cluster's front door for ``/v2/models/stats`` expects the cluster's. Each replica publishes its statistics
document to one StatsBoard (a one-replica deployment) every second and whenever it answers a statistics request;
the board answers with the sum over the replicas heard from in the last few seconds. So the replica answering has
its own counts fresh and the others' at most a second old; a replica that died drops out of the sum (as a restarted
`kiln serve` starts its counts from zero)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.cluster.metrics import merge_expositions, request_path

log = logging.getLogger("kiln.cluster")

PUBLISH_INTERVAL_S = 1.0
FORGET_AFTER_S = 5.0  # a replica silent this long is gone (killed, scaled down)

Document = list[dict[str, Any]]  # the statistics extension's "model_stats" list
Publish = Callable[[Document], Awaitable[Document]]
T = TypeVar("T")


class StatsBoard:
    """The latest statistics document of every replica; ``report`` stores one and returns the sum of all."""

    def __init__(self) -> None:
        self._latest: dict[str, tuple[float, Document]] = {}
        self._metrics: dict[str, tuple[float, str]] = {}  # by replica label: when, its Prometheus text

    async def report(self, replica: str, document: Document) -> Document:
        now = time.monotonic()
        self._latest[replica] = (now, document)
        self._latest = {r: entry for r, entry in self._latest.items() if now - entry[0] < FORGET_AFTER_S}
        return sum_documents([doc for _, doc in self._latest.values()])

    async def report_metrics(self, replica: str, text: str, merged: bool = True) -> str:
        """Store one replica's Prometheus text; every live replica's, merged and labelled by replica (only when
        ``merged``: the periodic publishes need no answer, and merging is the board's one real cost)."""
        now = time.monotonic()
        self._metrics[replica] = (now, text)
        self._metrics = {r: entry for r, entry in self._metrics.items() if now - entry[0] < FORGET_AFTER_S}
        return merge_expositions({r: text for r, (_, text) in self._metrics.items()}) if merged else ""

    async def inferences_by_replica(self) -> dict[str, int]:
        """Inferences each replica reported, over all models: how the load spread."""
        return {replica: sum(int(entry["inference_count"]) for entry in document)
                for replica, (_, document) in self._latest.items()}


def sum_documents(documents: list[Document]) -> Document:
    """One entry per (name, version): counts and durations added, ``last_inference`` the latest."""
    total: dict[tuple[str, str], dict[str, Any]] = {}
    for document in documents:
        for entry in document:
            key = (entry["name"], entry["version"])
            total[key] = _add(total[key], entry) if key in total else entry
    return [total[key] for key in sorted(total)]


def _add(a: Any, b: Any, field: str = "") -> Any:
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, dict):
        return {key: _add(a.get(key), b.get(key), key) for key in a.keys() | b.keys()}
    if isinstance(a, list) and field == "batch_stats":
        by_size = {item["batch_size"]: item for item in a}
        for item in b:
            size = item["batch_size"]
            by_size[size] = _add(by_size[size], item) if size in by_size else item
        return [by_size[size] for size in sorted(by_size)]
    if isinstance(a, bool) or not isinstance(a, int):
        return a  # names, versions, lists kiln leaves empty (memory_usage)
    if field == "last_inference":
        return max(a, b)
    if field == "batch_size":
        return a
    return a + b


def is_statistics_path(path: str) -> bool:
    """``/v2/models/stats``, ``/v2/models/{m}/stats``, ``/v2/models/{m}/versions/{v}/stats``."""
    parts = path.split("/")
    if parts[:3] != ["", "v2", "models"] or parts[-1] != "stats":
        return False
    return len(parts) in (4, 5) or (len(parts) == 7 and parts[4] == "versions")


class ClusterStatistics:
    """An ASGI wrapper: statistics answers of the replica's own app get the cluster's sums. The replica's app
    answers first, so a wrong model or version gets exactly kiln serve's error, and its answer says which models
    and versions the request selects."""

    def __init__(self, app: ASGIApp, publish: Publish, local: Callable[[], Document]) -> None:
        self.app = app
        self._publish = publish
        self._local = local

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "GET" or not is_statistics_path(request_path(scope)):
            await self.app(scope, receive, send)
            return
        everything = request_path(scope) == "/v2/models/stats"
        await answer_rewritten(self.app, scope, receive, send, lambda body: self._summed(body, everything))

    async def _summed(self, body: bytes, everything: bool) -> bytes:
        """``everything``: all models' statistics, the cluster's rather than the models this replica holds."""
        selected = {(e["name"], e["version"]) for e in orjson.loads(body)["model_stats"]}
        try:
            total = await self._publish(self._local())
        except Exception:  # the board restarting: this replica's own counts are still an answer
            log.warning("statistics board unreachable; answering with this replica's statistics", exc_info=True)
            return body
        return orjson.dumps({"model_stats": [e for e in total if everything or (e["name"], e["version"]) in selected]})


async def answer_rewritten(app: ASGIApp, scope: Scope, receive: Receive, send: Send,
                           rewrite: Callable[[bytes], Awaitable[bytes]]) -> None:
    """Run ``app`` and send its answer, the body of a 200 answer replaced by ``rewrite(body)`` (an error passes as
    the app gave it)."""
    messages: list[Message] = []

    async def keep(message: Message) -> None:
        messages.append(message)

    await app(scope, receive, keep)
    start, body = messages[0], b"".join(m.get("body", b"") for m in messages[1:])
    if start["status"] == 200:
        body = await rewrite(body)
        headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
        start = {**start, "headers": headers + [(b"content-length", str(len(body)).encode())]}
    await send(start)
    await send({"type": "http.response.body", "body": body})


async def publish_forever(publish: Callable[[T], Awaitable[Any]], local: Callable[[], T]) -> None:
    while True:
        await asyncio.sleep(PUBLISH_INTERVAL_S)
        try:
            await publish(local())
        except Exception:  # retried next interval; the board may be restarting
            log.debug("publish to the statistics board failed", exc_info=True)
