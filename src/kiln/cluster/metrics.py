"""Prometheus metrics of every replica at the cluster's front door: ``GET /metrics`` on the Ray proxy answers with
the ``nv_*`` series (and the CPU/GPU ones) of every live replica, each sample labelled ``replica="<id>"``.

Each replica renders its own registry (kiln.frontends.metrics, the text `kiln serve` gives on its metrics port)
and publishes it to the StatsBoard every second and whenever it answers ``/metrics``; the board keeps the latest
text per replica and merges them, one ``# HELP``/``# TYPE`` header per family and every replica's samples under it.
One scrape target for the whole application, wherever Ray placed the replicas; a Prometheus scraping the proxy
needs no service discovery of Ray actors, and a replica that died drops out of the answer (its counters restart
from zero in a replacement, which has a new replica label, as a restarted `kiln serve` pod has a new instance)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from kiln.frontends.metrics import METRICS_CONTENT_TYPE

REPLICA_LABEL = "replica"
METRICS_PATH = "/metrics"

PublishMetrics = Callable[[str], Awaitable[str]]  # this replica's text in, every live replica's merged text out


def merge_expositions(texts: dict[str, str]) -> str:
    """Prometheus text of several replicas as one exposition: per family, the header lines of the first replica
    (in order) that has it, then every replica's samples with a ``replica`` label added."""
    owner: dict[str, str] = {}  # family -> the replica whose header lines it keeps
    families: dict[str, list[str]] = {}  # family -> header lines
    samples: dict[str, list[str]] = {}
    for replica in sorted(texts):
        family = ""
        for line in texts[replica].splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split(" ", 3)[2]
                owner.setdefault(family, replica)
                families.setdefault(family, [])
                samples.setdefault(family, [])
                if owner[family] == replica:
                    families[family].append(line)
            elif line and not line.startswith("#"):
                samples.setdefault(family, []).append(with_label(line, REPLICA_LABEL, replica))
    lines: list[str] = []
    for family, family_samples in samples.items():
        lines += families.get(family, []) + family_samples
    return "\n".join(lines) + "\n"


def with_label(sample: str, label: str, value: str) -> str:
    """``name{a="1"} 3`` -> ``name{<label>="<value>",a="1"} 3``; ``name 3`` -> ``name{<label>="<value>"} 3``."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    brace, space = sample.find("{"), sample.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        rest = sample[brace + 1:]
        return f'{sample[:brace]}{{{label}="{escaped}"{"" if rest.startswith("}") else ","}{rest}'
    return f'{sample[:space]}{{{label}="{escaped}"}}{sample[space:]}'


class ClusterMetrics:
    """An ASGI wrapper answering ``GET /metrics`` with every live replica's metrics; other requests pass on."""

    def __init__(self, app: ASGIApp, publish: PublishMetrics, local: Callable[[], str]) -> None:
        self.app = app
        self._publish = publish
        self._local = local

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "GET" or request_path(scope) != METRICS_PATH:
            await self.app(scope, receive, send)
            return
        body = (await self._publish(self._local())).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", METRICS_CONTENT_TYPE.encode()),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def request_path(scope: Scope) -> str:
    """The path below the application's route prefix (Serve puts the prefix in ``root_path``)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path
