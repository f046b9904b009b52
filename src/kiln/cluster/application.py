"""The Ray Serve application: one ingress deployment whose replicas each hold a kiln.Server over the model
repository and serve kiln's own HTTP app (every KServe V2 / Triton route and error exactly as ``kiln serve``), plus
the StatsBoard that sums their statistics.

By default one deployment holds the whole repository: a kiln.Server is the unit that answers the protocol
(ensembles and routing call other models in the same process, the repository index and readiness cover all models),
and it needs no router in front. A repository larger than one replica should hold is split into one application
per model (split.py): each replica then holds one model (with its ensemble's steps) and asks Ray for that model's
GPUs (options.replica_gpus)."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from kiln import Server, ServerOptions
from kiln.cluster.grpc_ingress import call_servicer, statistics_response, with_grpc_methods
from kiln.cluster.metrics import ClusterMetrics
from kiln.cluster.options import API_KEY_VARIABLE, ClusterOptions
from kiln.cluster.split import BelowModelPrefix, ClusterFront, model_applications
from kiln.cluster.stats import ClusterStatistics, Document, StatsBoard, publish_forever
from kiln.config.repository import scan_repositories
from kiln.errors import UnavailableError
from kiln.frontends.grpc.servicer import GRPCInferenceService
from kiln.frontends.http import build_app
from kiln.frontends.http.capture import CaptureOptions, replica_capture
from kiln.frontends.http.documents import statistics_doc
from kiln.frontends.http.files import DownloadOptions
from kiln.frontends.metrics import metrics_registry, render_metrics
from kiln.heap import keep_freed_heap

log = logging.getLogger("kiln.cluster")

# Requests one replica takes at once before Serve queues them at the proxy. kiln batches and queues inside the
# Server, so a replica should see enough concurrent requests to fill its batches (Serve's default is 5).
MAX_ONGOING_REQUESTS = 256
# A dead replica is noticed by the controller's health check; a short period gets it replaced within seconds.
HEALTH_CHECK_PERIOD_S = 2.0
# As `kiln serve`: no line per request (Serve's default logs each one from every replica to the driver).
LOGGING = {"enable_access_log": False}


@with_grpc_methods  # Triton's gRPC RPCs, for Serve's gRPC proxy (grpc_ingress.py)
class KilnReplica:
    """One replica: a kiln.Server over the repository, its models loaded before the replica reports ready."""

    # Serve awaits an async constructor: the models load before the replica takes requests.
    async def __init__(self, repository: str, board: DeploymentHandle[Any] | str,  # type: ignore[misc,unused-ignore]
                       poll_secs: float | None = None, allow_model_download: bool = False,
                       capture_dir: str | None = None, capture_max_mb: int = 1024,
                       models: list[str] | None = None) -> None:
        """``board``: the statistics board, or the name of the application whose board to report to; ``models``:
        the models this replica holds (None: all; none at all: the front of a split repository)."""
        keep_freed_heap()  # the actor's process is this replica's alone; request bodies come and go (kiln/heap.py)
        self.server = Server(ServerOptions(repositories=[Path(repository)],
                                           control_mode="none" if poll_secs is None else "poll",
                                           serve_models=None if models is None else tuple(models)))
        self._board = board if not isinstance(board, str) else serve.get_deployment_handle(
            board_name(board), app_name=board, _check_exists=False)
        self._models = models
        # The front of a split repository expects every model found now to be served by some replica.
        self._expected = set(scan_repositories([Path(repository)]).models) if models == [] else set()
        replica_id = serve.get_replica_context().replica_id
        self._replica, self._label = str(replica_id), replica_id.unique_id  # the label: its actor name's end
        self._metrics = metrics_registry(self.server)
        self.grpc_servicer = GRPCInferenceService(self.server)
        # As `kiln serve --api-key`: the key comes from the replica's environment (API_KEY_VARIABLE), never from
        # the application's arguments, which Serve shows to anyone who can read its status.
        api_key = os.environ.get(API_KEY_VARIABLE) or None
        self._downloads = DownloadOptions(allow_model_download, api_key)
        self._capture = CaptureOptions(api_key=api_key) if capture_dir is None else replica_capture(
            Path(capture_dir), self._label, capture_max_mb * 2**20, api_key)
        failed = await asyncio.get_running_loop().run_in_executor(None, start_with_fallback, self.server)
        if failed:
            self.server.close()
            # As `kiln serve` exits by default: a replica missing models would answer differently from the others.
            raise UnavailableError(f"model(s) {', '.join(failed)} failed to load from {repository}")
        loop = asyncio.get_running_loop()
        self._publisher = loop.create_task(publish_forever(self._publish, self._statistics))
        self._metrics_publisher = loop.create_task(publish_forever(self._store_metrics, self._metrics_text))
        self._poller = loop.create_task(poll_forever(self.server, poll_secs)) if poll_secs is not None else None

    def __serve_build_asgi_app__(self) -> Any:
        app = build_app(self.server, downloads=self._downloads, capture=self._capture)
        statistics = ClusterStatistics(app, self._publish, self._statistics)
        served: Any = ClusterMetrics(statistics, self._publish_metrics, self._metrics_text)
        if self._models == []:  # the front of a split repository
            return ClusterFront(served, lambda: self._publish(self._statistics()), self._expected)
        return BelowModelPrefix(served) if self._models else served

    async def check_health(self) -> None:
        if not self.server.live():
            raise UnavailableError(f"replica {self._replica}: the kiln server is not live")

    def __del__(self) -> None:
        publisher = getattr(self, "_publisher", None)  # absent when __init__ failed
        if publisher is not None:
            publisher.cancel()
            self._metrics_publisher.cancel()
            if self._poller is not None:
                self._poller.cancel()
            self.server.close()

    async def ModelStatistics(self, request: Any, grpc_context: Any) -> Any:
        """The statistics RPC with the cluster's sums, as the HTTP statistics routes answer: the replica's own
        answer first (a wrong model or version gets kiln serve's error), then the sums of what it selected."""
        own = await call_servicer(self.grpc_servicer, "ModelStatistics", request, grpc_context)
        selected = {(entry.name, entry.version) for entry in own.model_stats}
        everything = not request.name
        try:
            total = await self._publish(self._statistics())
        except Exception:  # the board restarting: this replica's own counts are still an answer
            log.warning("statistics board unreachable; answering with this replica's statistics", exc_info=True)
            return own
        return statistics_response([e for e in total if everything or (e["name"], e["version"]) in selected])

    def _statistics(self) -> Document:
        document: Document = statistics_doc(self.server.model_statistics())["model_stats"]
        return document

    def _metrics_text(self) -> str:
        return render_metrics(self._metrics).decode()

    async def _publish_metrics(self, text: str) -> str:
        merged: str = await self._board.report_metrics.remote(self._label, text)
        return merged

    async def _store_metrics(self, text: str) -> None:
        await self._board.report_metrics.remote(self._label, text, False)

    async def _publish(self, document: Document) -> Document:
        total: Document = await self._board.report.remote(self._replica, document)
        return total


def start_with_fallback(server: Server) -> list[str]:
    """Load the repository; a model whose newest version fails serves the newest version that loads. Running
    replicas keep the version they serve when a corrupt one is published; a replica starting later (a replacement,
    a scale-up) must serve that same version rather than fail. Returns the models with no version that loads."""
    failed = server.start()
    for name in failed:
        server.fall_back(name)  # logs the version it serves
    return [name for name in failed if not server.model_ready(name)]  # an ensemble is ready once its steps are


async def poll_forever(server: Server, interval_s: float) -> None:
    """Apply repository changes every ``interval_s``, off the event loop (what `kiln serve` does in poll mode): a
    new version loads beside the served one, which keeps answering until the new one is ready."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval_s)
        try:
            changed = await loop.run_in_executor(None, server.poll)
        except Exception:  # a scan error must not stop polling; it is retried next time
            log.exception("repository poll failed")
            continue
        if changed:
            log.info("repository poll applied changes to: %s", ", ".join(changed))


def board_name(application: str) -> str:
    return f"{application}-stats"


def build_application(options: ClusterOptions) -> Application:
    board: Any = options.stats_app or serve.deployment(
        name=board_name(options.name), num_replicas=1, ray_actor_options={"num_cpus": 0},
        logging_config=LOGGING)(StatsBoard).bind()
    scaling: dict[str, Any] = {"autoscaling_config": options.autoscaling_config()} \
        if options.max_replicas is not None else {"num_replicas": options.num_replicas}
    ingress = serve.deployment(name=options.name, ray_actor_options=options.ray_actor_options(),
                               max_ongoing_requests=MAX_ONGOING_REQUESTS, health_check_period_s=HEALTH_CHECK_PERIOD_S,
                               logging_config=LOGGING, **scaling)(serve.ingress()(KilnReplica))
    capture_dir = None if options.capture_dir is None else str(options.capture_dir.resolve())
    return ingress.bind(str(options.model_repository.resolve()), board, options.repository_poll_secs,
                        options.allow_model_download, capture_dir, options.capture_max_mb,
                        None if options.models is None else list(options.models))


@dataclass(frozen=True)
class ClusterApplication:
    name: str
    route_prefix: str
    application: Application


def build_applications(options: ClusterOptions) -> list[ClusterApplication]:
    """What ``kiln cluster serve`` runs: the application, or for ``per_model`` the front (first: the others
    report to its board) and one application per model."""
    if not options.per_model:
        return [ClusterApplication(options.name, options.route_prefix, build_application(options))]
    # The front holds no model: no GPU, one replica (model traffic never crosses it).
    front = replace(options, per_model=False, models=(), num_gpus=0.0, num_replicas=1, min_replicas=None,
                    max_replicas=None)
    names = sorted(scan_repositories([options.model_repository]).models)
    return [ClusterApplication(options.name, options.route_prefix, build_application(front))] + [
        ClusterApplication(m.name, m.route_prefix, build_application(
            replace(options, per_model=False, models=(m.model,), name=m.name, stats_app=options.name)))
        for m in model_applications(options.name, options.route_prefix, names)]


def app(args: dict[str, Any]) -> Application:
    """The builder ``serve run kiln.cluster:app model_repository=PATH [num_replicas=N ...]`` calls."""
    return build_application(ClusterOptions.from_args(args))
