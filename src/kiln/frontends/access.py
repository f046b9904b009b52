"""Which API group every endpoint kiln serves belongs to, and the restrictions an operator put on groups.

The groups are Triton's (``--http-restricted-api`` / ``--grpc-restricted-protocol``): health, metadata,
inference, shared-memory, model-config, model-repository, statistics, trace, logging; plus kiln's own extensions
(model-download, capture, routing, console). A restriction names groups and one header with its value: a request to a
restricted group must carry that header with that value, else it is answered PERMISSION_DENIED (HTTP 403). HTTP
reads the header ``<key>``; gRPC reads the metadata key ``triton-grpc-protocol-<key>``, as Triton does.

The two tables below name every HTTP route and every gRPC method kiln serves; a test checks them against the real
route table and the service descriptors, so an endpoint cannot be added unclassified. docs/security.md lists them.
This module imports neither starlette nor grpc: the worker processes and the flags use it too.
"""

from __future__ import annotations

import hmac
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kiln.errors import InvalidArgumentError, PermissionDeniedError

HEALTH = "health"
METADATA = "metadata"
INFERENCE = "inference"
SHARED_MEMORY = "shared-memory"
MODEL_CONFIG = "model-config"
MODEL_REPOSITORY = "model-repository"
STATISTICS = "statistics"
TRACE = "trace"
LOGGING = "logging"
TRITON_GROUPS = (HEALTH, METADATA, INFERENCE, SHARED_MEMORY, MODEL_CONFIG, MODEL_REPOSITORY, STATISTICS, TRACE,
                 LOGGING)
# kiln's extensions, HTTP only.
MODEL_DOWNLOAD = "model-download"
CAPTURE = "capture"
ROUTING = "routing"
CONSOLE = "console"  # the browser console's page, files and status document (kiln/console/)
KILN_GROUPS = (MODEL_DOWNLOAD, CAPTURE, ROUTING, CONSOLE)

GRPC_HEADER_PREFIX = "triton-grpc-protocol-"
"""What gRPC puts before a restriction's key, as Triton does (clients send ``triton-grpc-protocol-<key>``)."""

_MODEL = "/v2/models/{model}"
_VERSION = "/v2/models/{model}/versions/{version}"
_FILES = "/v2/kiln/models/{model}/versions/{version}"

HTTP_ROUTES: tuple[tuple[str, str, str], ...] = (
    # (method, path as the route table spells it, group); tried in order, so /v2/models/stats before {model}
    ("GET", "/v2/models/stats", STATISTICS),
    ("GET", "/v2/health/live", HEALTH),
    ("GET", "/v2/health/ready", HEALTH),
    ("GET", _MODEL + "/ready", HEALTH),
    ("GET", _VERSION + "/ready", HEALTH),
    ("GET", "/v2", METADATA),
    ("GET", _MODEL, METADATA),
    ("GET", _VERSION, METADATA),
    ("POST", _MODEL + "/infer", INFERENCE),
    ("POST", _VERSION + "/infer", INFERENCE),
    ("POST", _MODEL + "/generate", INFERENCE),
    ("POST", _VERSION + "/generate", INFERENCE),
    ("POST", _MODEL + "/generate_stream", INFERENCE),
    ("POST", _VERSION + "/generate_stream", INFERENCE),
    ("GET", _MODEL + "/config", MODEL_CONFIG),
    ("GET", _VERSION + "/config", MODEL_CONFIG),
    ("GET", _MODEL + "/stats", STATISTICS),
    ("GET", _VERSION + "/stats", STATISTICS),
    ("POST", "/v2/repository/index", MODEL_REPOSITORY),
    ("POST", "/v2/repository/{repository}/index", MODEL_REPOSITORY),
    ("POST", "/v2/repository/models/{model}/load", MODEL_REPOSITORY),
    ("POST", "/v2/repository/models/{model}/unload", MODEL_REPOSITORY),
    *((method, base + suffix, SHARED_MEMORY) for base in ("/v2/systemsharedmemory", "/v2/cudasharedmemory")
      for method, suffix in (("GET", "/status"), ("GET", "/region/{region}/status"),
                             ("POST", "/region/{region}/register"), ("POST", "/unregister"),
                             ("POST", "/region/{region}/unregister"))),
    ("GET", _FILES + "/files", MODEL_DOWNLOAD),
    ("GET", _FILES + "/files/{path:path}", MODEL_DOWNLOAD),
    ("POST", _FILES + "/capture", CAPTURE),
    ("GET", "/v2/repository/models/{model}/kiln/routing", ROUTING),
    ("POST", "/v2/repository/models/{model}/kiln/routing", ROUTING),
    ("GET", "/v2/openapi.json", METADATA),  # the API described: as open as the server's metadata
    ("GET", "/console", CONSOLE),
    ("GET", "/console/api", CONSOLE),
    ("GET", "/console/static/{name}", CONSOLE),
    ("GET", "/console/report/{name}", CONSOLE),
    ("GET", "/v2/kiln/console/status", CONSOLE),
)

_INFERENCE_SERVICE = "inference.GRPCInferenceService"
_HEALTH_SERVICE = "grpc.health.v1.Health"
GRPC_METHODS: dict[str, str] = {
    # full method name, as gRPC hands it to an interceptor -> group
    **{f"/{_INFERENCE_SERVICE}/{name}": group for name, group in (
        ("ServerLive", HEALTH), ("ServerReady", HEALTH), ("ModelReady", HEALTH),
        ("ServerMetadata", METADATA), ("ModelMetadata", METADATA),
        ("ModelInfer", INFERENCE), ("ModelStreamInfer", INFERENCE),
        ("ModelConfig", MODEL_CONFIG), ("ModelStatistics", STATISTICS),
        ("RepositoryIndex", MODEL_REPOSITORY), ("RepositoryModelLoad", MODEL_REPOSITORY),
        ("RepositoryModelUnload", MODEL_REPOSITORY),
        ("SystemSharedMemoryStatus", SHARED_MEMORY), ("SystemSharedMemoryRegister", SHARED_MEMORY),
        ("SystemSharedMemoryUnregister", SHARED_MEMORY), ("CudaSharedMemoryStatus", SHARED_MEMORY),
        ("CudaSharedMemoryRegister", SHARED_MEMORY), ("CudaSharedMemoryUnregister", SHARED_MEMORY),
        ("TraceSetting", TRACE), ("LogSettings", LOGGING))},
    # Triton's health group covers the standard gRPC health service too.
    f"/{_HEALTH_SERVICE}/Check": HEALTH,
    f"/{_HEALTH_SERVICE}/Watch": HEALTH,
}

HTTP_GROUPS = TRITON_GROUPS + KILN_GROUPS
GRPC_GROUPS = TRITON_GROUPS


@dataclass(frozen=True)
class Restriction:
    """``groups`` answer only requests whose header ``key`` (HTTP; ``triton-grpc-protocol-<key>`` over gRPC)
    holds ``value``."""

    groups: frozenset[str]
    key: str
    value: str


def parse_restriction(text: str, flag: str, known: Iterable[str]) -> Restriction:
    """``<group>[,<group>...]:<key>=<value>``, the form of Triton's ``--http-restricted-api`` and
    ``--grpc-restricted-protocol``; ``known``: the groups ``flag`` accepts."""
    groups_text, colon, setting = text.partition(":")
    key, equals, value = setting.partition("=")
    groups = [g.strip() for g in groups_text.split(",") if g.strip()]
    if not colon or not equals or not groups or not key.strip():
        raise InvalidArgumentError(f"{flag} '{text}': expected <group>[,<group>...]:<key>=<value>, e.g. "
                                   f"model-repository,shared-memory:admin-key=secret")
    known = tuple(known)
    unknown = [g for g in groups if g not in known]
    if unknown:
        raise InvalidArgumentError(f"{flag} '{text}': unknown API group '{unknown[0]}'; expected one of "
                                   f"{', '.join(known)}")
    return Restriction(frozenset(groups), key.strip().lower(), value)


class AccessPolicy:
    """The restrictions of one protocol, checked per request by group. A group sits in at most one
    restriction (Triton refuses the same group in two)."""

    def __init__(self, restrictions: Iterable[Restriction] = (), flag: str = "--http-restricted-api",
                 header_prefix: str = "") -> None:
        self.restrictions = tuple(restrictions)
        self.header_prefix = header_prefix
        self._by_group: dict[str, Restriction] = {}
        for restriction in self.restrictions:
            for group in sorted(restriction.groups):
                if group in self._by_group:
                    raise InvalidArgumentError(f"{flag}: API group '{group}' is given in more than one "
                                               f"restriction; each group takes one key=value")
                self._by_group[group] = restriction

    def __bool__(self) -> bool:
        return bool(self.restrictions)

    def header(self, group: str) -> str | None:
        """The header (gRPC: metadata key) a request to ``group`` must carry; None when the group is open."""
        restriction = self._by_group.get(group)
        return None if restriction is None else self.header_prefix + restriction.key

    def check(self, group: str | None, headers: Mapping[str, str]) -> None:
        """Pass when ``group`` is open or ``headers`` (keys in lower case) carry its header with the value; else
        PermissionDeniedError naming the group and the header. The comparison takes the same time whatever the
        value sent."""
        if group is None:
            return
        restriction = self._by_group.get(group)
        if restriction is None:
            return
        header = self.header_prefix + restriction.key
        sent = headers.get(header)
        if sent is not None and hmac.compare_digest(sent.encode(), restriction.value.encode()):
            return
        raise PermissionDeniedError(f"the '{group}' API is restricted on this server: send the header '{header}' "
                                    f"with the value the server was started with")

    def describe(self) -> str:
        """The restrictions for a log line: groups and header, never the value."""
        return "; ".join(f"{','.join(sorted(r.groups))} need header '{self.header_prefix + r.key}'"
                         for r in self.restrictions)

    def to_json(self) -> str:
        """What a worker process receives (in its environment, which ``ps`` does not show) to rebuild this."""
        return json.dumps({"prefix": self.header_prefix,
                           "restrictions": [[sorted(r.groups), r.key, r.value] for r in self.restrictions]})

    @classmethod
    def from_json(cls, text: str) -> AccessPolicy:
        document = json.loads(text)
        return cls((Restriction(frozenset(groups), key, value) for groups, key, value in document["restrictions"]),
                   header_prefix=document["prefix"])


def http_policy(texts: Iterable[str]) -> AccessPolicy:
    """The policy of ``--http-restricted-api`` values."""
    flag = "--http-restricted-api"
    return AccessPolicy((parse_restriction(t, flag, HTTP_GROUPS) for t in texts), flag)


def grpc_policy(texts: Iterable[str]) -> AccessPolicy:
    """The policy of ``--grpc-restricted-protocol`` values."""
    flag = "--grpc-restricted-protocol"
    return AccessPolicy((parse_restriction(t, flag, GRPC_GROUPS) for t in texts), flag, GRPC_HEADER_PREFIX)


def _pattern(path: str) -> re.Pattern[str]:
    """A route path as a regular expression, matching as Starlette does: ``{name}`` is one non-empty segment,
    ``{name:path}`` the rest of the path."""
    parts = re.split(r"(\{[^}]+\})", path)
    regex = "".join(("(.+)" if p.endswith(":path}") else "([^/]+)") if p.startswith("{") else re.escape(p)
                    for p in parts)
    return re.compile(f"^{regex}$")


_HTTP_MATCHERS = tuple((method, _pattern(path), group) for method, path, group in HTTP_ROUTES)


def http_group(method: str, path: str) -> str | None:
    """The group of an HTTP request; None for a path and method kiln serves nothing at (the router answers 404
    or 405). HEAD is GET's (Starlette answers it with the GET route)."""
    method = "GET" if method == "HEAD" else method
    for route_method, pattern, group in _HTTP_MATCHERS:
        if route_method == method and pattern.match(path):
            return group
    return None


def grpc_group(method: str) -> str | None:
    """The group of a gRPC method (``/package.Service/Method``); None for one kiln does not serve."""
    return GRPC_METHODS.get(method)


WORKER_ENVIRONMENT = "KILN_ACCESS_POLICY"
"""Where a worker process (--http-workers, --grpc-workers) finds its protocol's policy, as :meth:`to_json` wrote
it: the environment, not the command line, since any user's ``ps`` shows command lines."""


def worker_environment(policy: AccessPolicy | None) -> dict[str, str]:
    """The environment to start a worker with: this process's, with the policy (and no stray one without)."""
    environment = {k: v for k, v in os.environ.items() if k != WORKER_ENVIRONMENT}
    if policy:
        environment[WORKER_ENVIRONMENT] = policy.to_json()
    return environment


def policy_from_environment() -> AccessPolicy | None:
    """The policy the server process handed this worker down, None when it gave none."""
    text = os.environ.get(WORKER_ENVIRONMENT)
    return AccessPolicy.from_json(text) if text else None
