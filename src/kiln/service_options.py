"""Everything ``kiln serve`` takes, declared once: each field is an option with its flag (kiln/_flags.py).

``ServiceOptions`` holds the frontends' and the process's options and one :class:`ServerOptions` (which is the
repository manager's options plus the server's own); ``kiln serve`` derives its flags from these declarations and
hands the one object to :func:`kiln.service.run_service`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kiln._flags import flag, non_negative, positive_seconds, seconds
from kiln.errors import InvalidArgumentError
from kiln.frontends.access import GRPC_GROUPS, HTTP_GROUPS, AccessPolicy, grpc_policy, http_policy
from kiln.server.server import ServerOptions

if TYPE_CHECKING:
    from kiln.frontends.grpc.access import GrpcTls
    from kiln.frontends.http.limits import HttpLimits
    from kiln.frontends.metrics import MetricsOptions


def default_http_workers() -> int:
    """`kiln serve`'s --http-workers: 1 (HTTP in the server process) with fewer than 8 usable CPUs, else a quarter
    of them, at most 4. One event loop carries HTTP up to a few thousand requests/s; the server process keeps the
    other cores for its engines, and a worker past four rarely finds a core idle."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return 1 if cpus < 8 else min(4, cpus // 4)


def default_grpc_workers() -> int:
    """`kiln serve`'s --grpc-workers: as many as --http-workers's default where that runs workers (8 or more usable
    CPUs), else 0 (gRPC in the server process). In the server process grpc.aio takes most of a core for itself
    and hands calls over one by one (docs/serving.md, "gRPC workers")."""
    workers = default_http_workers()
    return workers if workers > 1 else 0


@dataclass(frozen=True)
class ServiceOptions:
    server: ServerOptions = field(default_factory=ServerOptions)
    host: str = field(default="127.0.0.1", metadata=flag("--host", help="address to listen on (default 127.0.0.1)"))
    http_port: int = field(default=8000, metadata=flag("--http-port"))
    grpc_port: int = field(default=8001, metadata=flag("--grpc-port"))
    metrics_port: int = field(default=8002, metadata=flag("--metrics-port"))
    allow_http: bool = field(default=True, metadata=flag("--allow-http"))
    allow_grpc: bool = field(default=True, metadata=flag("--allow-grpc"))
    allow_metrics: bool = field(default=True, metadata=flag("--allow-metrics"))
    http_max_input_size: int = field(default=64 * 2**20, metadata=flag(
        "--http-max-input-size", metavar="BYTES", help="largest accepted HTTP request body (default 64 MiB)"))
    grpc_max_message_bytes: int = field(default=2**31 - 1, metadata=flag("--grpc-max-message-size", metavar="BYTES"))
    # -- connection limits and timeouts (frontends/http/limits.py, frontends/grpc/server.py; docs/serving.md) --
    http_max_header_bytes: int = field(default=64 * 2**10, metadata=flag(
        "--http-max-header-size", parse=non_negative, metavar="BYTES",
        help="largest HTTP request head (request line and headers); larger ones are answered 431 (default 65536)"))
    http_max_header_count: int = field(default=100, metadata=flag(
        "--http-max-header-count", parse=non_negative, metavar="N",
        help="most header fields in one HTTP request; more are answered 431 (default 100)"))
    http_header_timeout_s: float = field(default=30.0, metadata=flag(
        "--http-header-timeout-secs", parse=seconds, metavar="SECS",
        help="time a client has to send a request head, from connecting or from a keep-alive request's first byte; "
             "then 408 and close (default 30; 0: none)"))
    http_idle_timeout_s: float = field(default=60.0, metadata=flag(
        "--http-idle-timeout-secs", parse=positive_seconds, metavar="SECS",
        help="close a keep-alive HTTP connection idle this long between requests (default 60)"))
    http_body_timeout_s: float = field(default=300.0, metadata=flag(
        "--http-body-timeout-secs", parse=seconds, metavar="SECS",
        help="time a client has to send a request body once its head is in; then the connection is closed "
             "(default 300; 0: none)"))
    http_max_connections: int = field(default=4096, metadata=flag(
        "--http-max-connections", parse=non_negative, metavar="N",
        help="open HTTP connections per process (each HTTP worker, or the server process); new ones beyond it are "
             "accepted and closed at once (default 4096)"))
    grpc_keepalive_s: float = field(default=7200.0, metadata=flag(
        "--grpc-keepalive-secs", parse=positive_seconds, metavar="SECS",
        help="ping a gRPC client after this long without activity, and close its connection when the ping goes "
             "unanswered for 20 s (default 7200, gRPC's)"))
    grpc_max_connection_idle_s: float = field(default=3600.0, metadata=flag(
        "--grpc-max-connection-idle-secs", parse=seconds, metavar="SECS",
        help="close a gRPC connection without calls for this long (GOAWAY; clients reconnect) (default 3600; "
             "0: never)"))
    # -- end of connection limits and timeouts --
    # The API's default is gRPC in this process; `kiln serve`'s depends on the host (default_grpc_workers).
    grpc_workers: int = field(default=0, metadata=flag(
        "--grpc-workers", parse=non_negative, metavar="N", default=default_grpc_workers(),
        help="serve gRPC from N worker processes sharing the port, which decode ModelInfer and hand its tensors to "
             "this process in shared memory (0: gRPC runs in this process; default: 0 on hosts with fewer than 8 "
             "usable CPUs, else as --http-workers's default)"))
    # The API's default is today's one process; `kiln serve`'s depends on the host (default_http_workers).
    http_workers: int = field(default=1, metadata=flag(
        "--http-workers", parse=non_negative, metavar="N", default=default_http_workers(),
        help="serve HTTP from N worker processes sharing the port, which decode infer requests and hand their "
             "tensors to this process in shared memory (0 or 1: HTTP runs in this process; default: 1 on hosts "
             "with fewer than 8 usable CPUs, else min(4, CPUs / 4))"))
    exit_timeout_s: float = field(default=30.0, metadata=flag(
        "--exit-timeout-secs", help="how long shutdown waits for in-flight requests (default 30)"))
    metrics_config: tuple[str, ...] = field(default=(), metadata=flag(
        "--metrics-config", metavar="KEY=VALUE",
        help="counter_latencies, summary_latencies, histogram_latencies (true/false), "
             "summary_quantiles=0.5:0.05,0.9:0.01 (repeatable)"))
    allow_cpu_metrics: bool = field(default=True, metadata=flag("--allow-cpu-metrics"))
    allow_gpu_metrics: bool = field(default=True, metadata=flag("--allow-gpu-metrics"))
    repository_poll_secs: float = field(default=15.0, metadata=flag(
        "--repository-poll-secs", help="poll interval (poll mode)"))
    exit_on_error: bool = field(default=True, metadata=flag(
        "--exit-on-error", help="exit when a model fails to load at start (default true)"))
    gil_switch_interval_us: int | None = field(default=None, metadata=flag(
        "--gil-switch-interval-us", metavar="US",
        help="how long a thread may hold Python's GIL while another waits (default: Python's 5000); a shorter one "
             "lets a worker that has waited for the GPU take it back sooner (docs/pytorch-backend.md)"))
    allow_model_download: bool = field(default=False, metadata=flag(
        "--allow-model-download", form="switch",
        help="serve model version files with checksums to edges that sync (a kiln extension; off by default)"))
    # Required by the model-download and capture endpoints when set; an empty one is none.
    api_key: str | None = field(default=None, metadata=flag(
        "--api-key", env="KILN_API_KEY", metavar="KEY",
        help="bearer token the model-download and capture endpoints require (default: env KILN_API_KEY)"))
    capture_dir: Path | None = field(default=None, metadata=flag(  # None turns the capture endpoint off
        "--capture-dir", metavar="DIR",
        help="store samples edges capture for retraining in DIR (a kiln extension; off by default)"))
    capture_max_mb: int = field(default=1024, metadata=flag(
        "--capture-max-mb", metavar="MB",
        help="size bound of --capture-dir; the oldest samples are deleted past it (default 1024)"))
    # The browser console on the HTTP port (kiln/console/, docs/console.md).
    allow_console: bool = field(default=True, metadata=flag(
        "--allow-console", help="serve the browser console at /console on the HTTP port (default true)"))
    console_report: Path | None = field(default=None, metadata=flag(
        "--console-report", metavar="DIR",
        help="a `kiln bench compare` output folder (or a file in it) whose files the console links to"))
    # TLS on the HTTP frontend (gRPC's is below, metrics stay plain); with a client CA, client certs are required.
    https_certfile: Path | None = field(default=None, metadata=flag(
        "--https-certfile", metavar="CERT",
        help="serve the HTTP frontend over TLS with this PEM certificate (chain); gRPC has --grpc-use-ssl"))
    https_keyfile: Path | None = field(default=None, metadata=flag(
        "--https-keyfile", metavar="KEY", help="the PEM private key of --https-certfile"))
    https_client_ca: Path | None = field(default=None, metadata=flag(
        "--https-client-ca", metavar="CA",
        help="require HTTP clients to present a certificate signed by this CA (mTLS)"))
    # Access control (docs/security.md): Triton's restricted groups and gRPC TLS flags.
    http_restricted_api: tuple[str, ...] = field(default=(), metadata=flag(
        "--http-restricted-api", metavar="GROUPS:KEY=VALUE",
        help="answer the comma-separated API GROUPS over HTTP only to requests with header KEY set to VALUE, "
             "others 403 (repeatable; groups: " + ", ".join(HTTP_GROUPS) + ")"))
    grpc_restricted_protocol: tuple[str, ...] = field(default=(), metadata=flag(
        "--grpc-restricted-protocol", metavar="GROUPS:KEY=VALUE",
        help="answer the comma-separated protocol GROUPS over gRPC only to calls with metadata "
             "triton-grpc-protocol-KEY set to VALUE, others PERMISSION_DENIED (repeatable; groups: "
             + ", ".join(GRPC_GROUPS) + ")"))
    grpc_use_ssl: bool = field(default=False, metadata=flag(
        "--grpc-use-ssl", help="serve gRPC over TLS with --grpc-server-cert and --grpc-server-key (default false)"))
    grpc_use_ssl_mutual: bool = field(default=False, metadata=flag(
        "--grpc-use-ssl-mutual",
        help="serve gRPC over TLS and require client certificates signed by --grpc-root-cert (default false)"))
    grpc_server_cert: Path | None = field(default=None, metadata=flag(
        "--grpc-server-cert", metavar="CERT", help="the PEM certificate (chain) of gRPC's TLS"))
    grpc_server_key: Path | None = field(default=None, metadata=flag(
        "--grpc-server-key", metavar="KEY", help="the PEM private key of --grpc-server-cert"))
    grpc_root_cert: Path | None = field(default=None, metadata=flag(
        "--grpc-root-cert", metavar="CA", help="the PEM CA bundle client certificates must chain to"))
    log_verbose: int = field(default=0, metadata=flag("--log-verbose", help="0 = info, 1 or more = debug"))
    log_format: str = field(default="default", metadata=flag("--log-format", choices=("default", "ISO8601")))

    def __post_init__(self) -> None:
        if not self.api_key:
            object.__setattr__(self, "api_key", None)  # frozen: normalised once, here
        if "*" in self.server.load_models and len(self.server.load_models) > 1:
            raise InvalidArgumentError("--load-model=* loads every model and must be the only --load-model")
        self._check_https()
        self._check_grpc_tls()
        self.http_access, self.grpc_access  # noqa: B018 -- a bad restriction fails here, before anything starts
        if self.console_report is not None and not Path(self.console_report).exists():
            raise InvalidArgumentError(f"--console-report '{self.console_report}' does not exist; expected the "
                                       "output folder of `kiln bench compare` (or a file in it)")
        self.metrics  # noqa: B018 -- a bad --metrics-config item fails here, before anything starts

    @property
    def metrics(self) -> MetricsOptions:
        """The metrics the registry exposes: --metrics-config items, then --allow-cpu/gpu-metrics."""
        # Imported here: every kiln command builds its parser from these declarations, and prometheus_client comes
        # only with the server extra (an edge device runs `kiln edge` without it).
        from kiln.frontends.metrics import parse_metrics_config

        return dataclasses.replace(parse_metrics_config(list(self.metrics_config)),
                                   cpu_metrics=self.allow_cpu_metrics, gpu_metrics=self.allow_gpu_metrics)

    @property
    def http_limits(self) -> HttpLimits:
        from kiln.frontends.http.limits import HttpLimits  # uvicorn comes with the server extra only

        return HttpLimits(max_header_bytes=self.http_max_header_bytes, max_headers=self.http_max_header_count,
                          header_timeout_s=self.http_header_timeout_s, idle_timeout_s=self.http_idle_timeout_s,
                          body_timeout_s=self.http_body_timeout_s, max_connections=self.http_max_connections)

    @property
    def capture_max_bytes(self) -> int:
        return self.capture_max_mb * 2**20

    @property
    def http_access(self) -> AccessPolicy:
        """--http-restricted-api as the frontends apply it (kiln/frontends/access.py)."""
        return http_policy(self.http_restricted_api)

    @property
    def grpc_access(self) -> AccessPolicy:
        """--grpc-restricted-protocol as the frontends apply it."""
        return grpc_policy(self.grpc_restricted_protocol)

    @property
    def grpc_tls(self) -> GrpcTls | None:
        """gRPC's TLS settings, the certificates loaded once to check them; None: plain gRPC."""
        from kiln.frontends.grpc.access import GrpcTls  # grpcio comes with the server extra only

        if not (self.grpc_use_ssl or self.grpc_use_ssl_mutual):
            return None
        assert self.grpc_server_cert is not None and self.grpc_server_key is not None  # _check_grpc_tls
        return GrpcTls(self.grpc_server_cert, self.grpc_server_key, self.grpc_root_cert, self.grpc_use_ssl_mutual)

    def _check_grpc_tls(self) -> None:
        files = (("--grpc-server-cert", self.grpc_server_cert), ("--grpc-server-key", self.grpc_server_key),
                 ("--grpc-root-cert", self.grpc_root_cert))
        if self.grpc_use_ssl or self.grpc_use_ssl_mutual:
            missing = [name for name, path in files[:2] if path is None]
            if self.grpc_use_ssl_mutual and self.grpc_root_cert is None:
                missing.append("--grpc-root-cert")
            if missing:
                used = "--grpc-use-ssl-mutual" if self.grpc_use_ssl_mutual else "--grpc-use-ssl"
                raise InvalidArgumentError(f"{used} needs {' and '.join(missing)}")
        elif any(path is not None for _, path in files):
            raise InvalidArgumentError("--grpc-server-cert, --grpc-server-key and --grpc-root-cert take effect "
                                       "with --grpc-use-ssl=true (or --grpc-use-ssl-mutual=true)")
        for name, path in files:
            if path is not None and not Path(path).is_file():
                raise InvalidArgumentError(f"{name} '{path}' is not a file")

    def _check_https(self) -> None:
        if (self.https_keyfile is not None or self.https_client_ca is not None) and self.https_certfile is None:
            raise InvalidArgumentError("--https-keyfile and --https-client-ca need --https-certfile (the server's "
                                       "certificate)")
        for name, path in (("--https-certfile", self.https_certfile), ("--https-keyfile", self.https_keyfile),
                           ("--https-client-ca", self.https_client_ca)):
            if path is not None and not Path(path).is_file():
                raise InvalidArgumentError(f"{name} '{path}' is not a file")

