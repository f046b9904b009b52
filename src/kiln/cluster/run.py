"""``kiln cluster serve``: connect to a Ray cluster (or start a local one), run the application, keep it up until
SIGINT/SIGTERM, then delete it (and stop the local cluster this process started)."""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from types import FrameType
from typing import Any

import ray
from ray import serve
from ray.serve.api import RunTarget

from kiln.cluster.application import build_applications
from kiln.cluster.grpc_ingress import SERVICER_FUNCTION
from kiln.cluster.ingress import ingress_environment
from kiln.cluster.options import ClusterOptions

log = logging.getLogger("kiln.cluster")

LOCAL = "local"


@dataclass(frozen=True)
class ProxyOptions:
    """Where Ray Serve's HTTP proxies listen (on every node); applied when Serve is not already running there."""

    host: str = "0.0.0.0"
    port: int = 8000
    grpc_port: int | None = None  # Triton's gRPC protocol at Serve's gRPC proxies on this port; None: no gRPC
    ingress: str = "haproxy"  # ingress.py

    def grpc_options(self) -> dict[str, Any] | None:
        if self.grpc_port is None:
            return None
        return {"port": self.grpc_port, "grpc_servicer_functions": [SERVICER_FUNCTION]}


def serve_cluster(address: str, options: ClusterOptions, proxy: ProxyOptions, *,
                  stop: threading.Event | None = None) -> int:
    """Run the application on the cluster at ``address`` ("local": a one-node cluster started here) until
    ``stop`` is set or a signal arrives."""
    environment = ingress_environment(proxy.ingress)
    os.environ.update(environment)  # a local cluster's processes inherit it
    ray.init(address=None if address == LOCAL else address, logging_level=logging.WARNING,
             runtime_env={"env_vars": environment})  # a running cluster gets it for this job's actors
    stop = stop or _stop_on_signals()  # after ray.init, which installs handlers of its own
    try:
        serve.start(http_options={"host": proxy.host, "port": proxy.port}, grpc_options=proxy.grpc_options(),
                    controller_options={"runtime_env": {"env_vars": environment}})
        front, *per_model = build_applications(options)
        serve.run(front.application, name=front.name, route_prefix=front.route_prefix)  # its board first
        if per_model:
            serve.run_many([RunTarget(a.application, a.name, a.route_prefix) for a in per_model])
        log.info("serving %s on the Ray cluster at %s: http://%s:%d%s (%s%s, %s ingress)", options.model_repository,
                 address, proxy.host, proxy.port, options.route_prefix, _scaling(options),
                 f" for each of {len(per_model)} models" if per_model else "", proxy.ingress)
        stop.wait()
        for application in [*per_model, front]:
            log.info("deleting application %s", application.name)
            serve.delete(application.name)
        if address == LOCAL:
            serve.shutdown()  # type: ignore[no-untyped-call,unused-ignore]
    finally:
        ray.shutdown()
    return 0


def _scaling(options: ClusterOptions) -> str:
    if options.max_replicas is None:
        return f"{options.num_replicas} replica(s)"
    return f"autoscaling {options.min_replicas or 1}..{options.max_replicas} replicas"


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    return stop
