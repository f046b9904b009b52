"""Prometheus exposition of the server's statistics with Triton's metric names (``nv_inference_*``).

Metrics are read from the statistics at scrape time, so the request path pays nothing for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.server.server import Server
from kiln.server.stats import ModelStats

_LABELS = ["model", "version"]


class ServerCollector(Collector):
    def __init__(self, server: Server) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        stats = self._server.model_statistics()
        counters: dict[str, tuple[str, Callable[[ModelStats], int]]] = {
            "nv_inference_request_success": ("Number of successful inference requests, all batch sizes",
                                             lambda s: s.success.count),
            "nv_inference_count": ("Number of inferences performed (a batch of n counts n)",
                                   lambda s: s.inference_count),
            "nv_inference_exec_count": ("Number of model executions performed", lambda s: s.execution_count),
            "nv_inference_request_duration_us": ("Cumulative inference request duration in microseconds",
                                                 lambda s: s.success.ns // 1000),
            "nv_inference_queue_duration_us": ("Cumulative inference queuing duration in microseconds",
                                               lambda s: s.queue.ns // 1000),
            "nv_inference_compute_input_duration_us": ("Cumulative compute input duration in microseconds",
                                                       lambda s: s.compute_input.ns // 1000),
            "nv_inference_compute_infer_duration_us": ("Cumulative compute inference duration in microseconds",
                                                       lambda s: s.compute_infer.ns // 1000),
            "nv_inference_compute_output_duration_us": ("Cumulative inference compute output duration in "
                                                        "microseconds", lambda s: s.compute_output.ns // 1000),
        }
        for name, (help_text, read) in counters.items():
            family = _counter(name, help_text)
            for s in stats:
                family.add_sample(name, {"model": s.name, "version": s.version}, read(s))
            yield family
        yield self._failures(stats)
        pending = GaugeMetricFamily("nv_inference_pending_request_count",
                                    "Instantaneous number of pending requests awaiting execution per-model.",
                                    labels=_LABELS)
        for s in stats:
            pending.add_metric([s.name, s.version], self._server.pending(s.name, s.version))
        yield pending

    @staticmethod
    def _failures(stats: list[ModelStats]) -> Metric:
        name = "nv_inference_request_failure"
        family = _counter(name, "Number of failed inference requests, all batch sizes")
        for s in stats:
            family.add_sample(name, {"model": s.name, "version": s.version, "reason": "BACKEND"}, s.fail.count)
        return family


def _counter(name: str, help_text: str) -> Metric:
    """A counter exposed under exactly Triton's name (prometheus_client would append ``_total``)."""
    return Metric(name, help_text, "counter")


def metrics_registry(server: Server) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(server))
    return registry
