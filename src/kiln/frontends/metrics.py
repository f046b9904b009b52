"""Prometheus exposition of the server's statistics under Triton's metric names, types and labels.

Per-model counters and gauges (``nv_inference_*``, ``nv_model_load_duration_secs``) are read from the statistics
at scrape time, so the request path pays nothing for them. The opt-in latency summaries and histogram are fed
per request (metrics_latency.py); host metrics come from psutil (metrics_cpu.py) and GPU metrics from NVML when
it is installed (metrics_gpu.py). Counters keep Triton's names, without the ``_total`` suffix: serve the text of
:func:`render_metrics`, which also writes those names in ``# HELP`` / ``# TYPE``. docs/metrics.md has the list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.errors import InvalidArgumentError, KilnError
from kiln.frontends.metrics_cpu import CpuCollector
from kiln.frontends.metrics_ensemble import ensemble_step_families
from kiln.frontends.metrics_gpu import gpu_collector
from kiln.frontends.metrics_latency import DEFAULT_BUCKETS_MS, DEFAULT_QUANTILES, HISTOGRAM_NAME, LatencyRecorder
from kiln.frontends.metrics_processes import ProcessCpuCollector, Processes
from kiln.server.server import Server
from kiln.server.stats import ModelStats

# Triton's text exposition (prometheus-cpp) is version 0.0.4 of the text format; render_metrics writes it.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")


@dataclass(frozen=True)
class MetricsOptions:
    """Which metrics the registry exposes. Triton's ``--metrics-config`` keys, plus its ``--allow-*-metrics``."""

    counter_latencies: bool = True
    summary_latencies: bool = False
    histogram_latencies: bool = False
    summary_quantiles: tuple[float, ...] = DEFAULT_QUANTILES
    cpu_metrics: bool = True
    gpu_metrics: bool = True

    def __post_init__(self) -> None:
        bad = [q for q in self.summary_quantiles if not 0.0 <= q <= 1.0]
        if bad:
            raise InvalidArgumentError(f"metrics: summary quantiles {bad} are out of range; expected values in [0, 1]")


def metrics_registry(server: Server, options: MetricsOptions | None = None,
                     processes: Processes | None = None) -> CollectorRegistry:
    """A registry with every metric ``options`` enables. Summaries or the histogram add a request observer.
    ``processes`` names the processes whose CPU time to expose with the CPU metrics (`kiln serve`'s and its
    workers': metrics_processes.py)."""
    options = options or MetricsOptions()
    latency = None
    if options.summary_latencies or options.histogram_latencies:
        latency = LatencyRecorder(summaries=options.summary_latencies, histogram=options.histogram_latencies,
                                  quantiles=options.summary_quantiles, buckets_for=_config_buckets(server))
        server.add_request_observer(latency.observe)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ModelCollector(server, options.counter_latencies, latency))
    if options.cpu_metrics:
        registry.register(CpuCollector())
        if processes is not None:
            registry.register(ProcessCpuCollector(processes))
    gpu = gpu_collector() if options.gpu_metrics else None
    if gpu is not None:
        registry.register(gpu)
    return registry


def render_metrics(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus text format exactly as Triton writes it.

    prometheus_client's ``generate_latest`` names every counter ``<name>_total`` in ``# HELP`` and ``# TYPE``
    while kiln's samples keep Triton's plain names; Prometheus would then see those samples as untyped. This
    writes the sample's name there instead, for every counter family none of whose samples ends in ``_total``.
    """
    lines = generate_latest(registry).decode().split("\n")
    for index, line in enumerate(lines):
        if not (line.startswith("# TYPE ") and line.endswith("_total counter")):
            continue
        name = line[len("# TYPE "):-len(" counter")]
        plain = name[:-len("_total")]
        if any(_sample_name(sample) == name for sample in _samples_after(lines, index)):
            continue
        lines[index] = f"# TYPE {plain} counter"
        if index and lines[index - 1].startswith(f"# HELP {name} "):
            lines[index - 1] = f"# HELP {plain} " + lines[index - 1][len(f"# HELP {name} "):]
    return "\n".join(lines).encode()


def _samples_after(lines: list[str], index: int) -> Iterator[str]:
    for line in lines[index + 1:]:
        if line.startswith("#"):
            return
        if line:
            yield line


def _sample_name(line: str) -> str:
    end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=len(line))
    return line[:end]


class ModelCollector(Collector):
    """Per model version: Triton's counters, the pending-request and load-duration gauges, opt-in latencies."""

    def __init__(self, server: Server, counter_latencies: bool = True, latency: LatencyRecorder | None = None) -> None:
        self._server = server
        self._counter_latencies = counter_latencies
        self._latency = latency

    def collect(self) -> Iterator[Metric]:
        listed_ns = self._latency.clock() if self._latency is not None else 0
        stats = self._server.model_statistics()
        yield _counter("nv_inference_request_success", "Number of successful inference requests, all batch sizes",
                       stats, lambda s: s.success.count)
        yield _failures(stats)
        yield _counter("nv_inference_count", "Number of inferences performed (a batch of n counts n)",
                       stats, lambda s: s.inference_count)
        yield _counter("nv_inference_exec_count", "Number of model executions performed",
                       stats, lambda s: s.execution_count)
        yield _counter("kiln_inference_joined_request_success",
                       "Successful requests that frontend worker processes joined from several clients' requests",
                       stats, lambda s: s.joined_requests)
        yield _counter("kiln_inference_joined_member_success",
                       "Clients' requests those joined requests carried (also counted in "
                       "nv_inference_request_success)", stats, lambda s: s.joined_members)
        yield _counter("kiln_inference_held_member_success",
                       "Clients' requests that frontend worker processes held back until an earlier call was "
                       "answered, to send them together (also counted in nv_inference_request_success)",
                       stats, lambda s: s.held_members)
        if self._counter_latencies:
            yield from _duration_counters(stats)
        yield self._gauge("nv_inference_pending_request_count",
                          "Instantaneous number of pending requests awaiting execution per-model.",
                          stats, lambda s: self._server.pending(s.name, s.version))
        yield self._gauge("nv_model_load_duration_secs", "Model load time in seconds",
                          stats, lambda s: s.load_duration_s)
        yield self._load_failures()
        yield from ensemble_step_families(self._server)
        yield self._shadow_requests()
        if self._latency is not None:
            yield from self._latency.families([(s.name, s.version) for s in stats], listed_ns)

    def _load_failures(self) -> Metric:
        """kiln's own: failed loads and reloads per model (Triton has no metric for them)."""
        name = "kiln_model_load_failure_count"
        family = Metric(name, "Number of failed model loads and reloads since start, per model", "counter")
        for model, count in sorted(self._server.load_failures().items()):
            family.add_sample(name, {"model": model}, count)
        return family

    def _shadow_requests(self) -> Metric:
        """kiln's own: requests mirrored to a shadow version, by result."""
        name = "kiln_shadow_requests"
        family = Metric(name, "Requests mirrored to a shadow version, by result", "counter")
        for model, s in self._server.shadow_statistics():
            for result, count in (("agreed", s.agreed), ("disagreed", s.disagreed), ("error", s.errors),
                                  ("skipped", s.skipped)):
                family.add_sample(name, {"model": model, "version": s.version, "result": result}, count)
        return family

    @staticmethod
    def _gauge(name: str, help_text: str, stats: list[ModelStats], read: Callable[[ModelStats], float]) -> Metric:
        family = GaugeMetricFamily(name, help_text, labels=["model", "version"])
        for s in stats:
            family.add_metric([s.name, s.version], read(s))
        return family


_DURATIONS: tuple[tuple[str, str, Callable[[ModelStats], int]], ...] = (
    ("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds",
     lambda s: s.success.ns),
    ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds",
     lambda s: s.queue.ns),
    ("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds",
     lambda s: s.compute_input.ns),
    ("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds",
     lambda s: s.compute_infer.ns),
    ("nv_inference_compute_output_duration_us", "Cumulative inference compute output duration in microseconds",
     lambda s: s.compute_output.ns),
)


def _duration_counters(stats: list[ModelStats]) -> Iterator[Metric]:
    for name, help_text, read_ns in _DURATIONS:
        yield _counter(name, help_text, stats, _microseconds(read_ns))


def _microseconds(read_ns: Callable[[ModelStats], int]) -> Callable[[ModelStats], int]:
    return lambda s: read_ns(s) // 1000


def _counter(name: str, help_text: str, stats: list[ModelStats], read: Callable[[ModelStats], float]) -> Metric:
    """A counter under exactly Triton's name (prometheus_client's own families would append ``_total``)."""
    family = Metric(name, help_text, "counter")
    for s in stats:
        family.add_sample(name, {"model": s.name, "version": s.version}, read(s))
    return family


def _failures(stats: list[ModelStats]) -> Metric:
    """Failed requests by Triton's four reasons, each always present; an unknown reason counts as OTHER."""
    name = "nv_inference_request_failure"
    family = Metric(name, "Number of failed inference requests, all batch sizes", "counter")
    for s in stats:
        counts = dict.fromkeys(FAILURE_REASONS, 0)
        for reason, count in s.failures_by_reason.items():
            counts[reason if reason in counts else "OTHER"] += count
        for reason, count in counts.items():
            family.add_sample(name, {"model": s.name, "version": s.version, "reason": reason}, count)
    return family


def _config_buckets(server: Server) -> Callable[[str, str], Sequence[float]]:
    """Histogram buckets from the model's ``model_metrics`` override (as in Triton), else the defaults."""

    def buckets(model: str, version: str) -> Sequence[float]:
        try:
            config = server.model_config(model, version)
        except KilnError:
            return DEFAULT_BUCKETS_MS
        for control in config.model_metrics.metric_control:
            if control.metric_identifier.family == HISTOGRAM_NAME and control.HasField("histogram_options"):
                return tuple(control.histogram_options.buckets) or DEFAULT_BUCKETS_MS
        return DEFAULT_BUCKETS_MS

    return buckets


# -- --metrics-config ------------------------------------------------------------------------------------------

_TRUE, _FALSE = ("true", "on", "1", "yes"), ("false", "off", "0", "no")


def parse_metrics_config(items: list[str]) -> MetricsOptions:
    """Options from Triton-style ``--metrics-config key=value`` items; a later item overrides an earlier one.

    Keys: counter_latencies, summary_latencies, histogram_latencies (booleans) and summary_quantiles
    (``"0.5:0.05,0.9:0.01"``: quantile:error pairs; kiln computes exact quantiles, so the error is checked and
    otherwise ignored). Raises InvalidArgumentError naming the item and what was expected.
    """
    options = MetricsOptions()
    for item in items:
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key:
            raise InvalidArgumentError(f"--metrics-config '{item}': expected key=value")
        if key == "counter_latencies":
            options = dataclasses.replace(options, counter_latencies=_parse_bool(key, value))
        elif key == "summary_latencies":
            options = dataclasses.replace(options, summary_latencies=_parse_bool(key, value))
        elif key == "histogram_latencies":
            options = dataclasses.replace(options, histogram_latencies=_parse_bool(key, value))
        elif key == "summary_quantiles":
            options = dataclasses.replace(options, summary_quantiles=_parse_quantiles(value))
        else:
            raise InvalidArgumentError(f"--metrics-config '{item}': unknown key '{key}'; expected one of: "
                                       f"counter_latencies, summary_latencies, histogram_latencies, "
                                       f"summary_quantiles")
    return options


def _parse_bool(key: str, value: str) -> bool:
    lowered = value.lower()
    if lowered in _TRUE or lowered in _FALSE:
        return lowered in _TRUE
    raise InvalidArgumentError(f"--metrics-config {key}={value}: expected true or false")


def _parse_quantiles(value: str) -> tuple[float, ...]:
    quantiles: set[float] = set()
    for pair in value.split(","):
        q_text, _, error_text = pair.strip().partition(":")
        try:
            q = float(q_text)
            error = float(error_text) if error_text else 0.0
        except ValueError:
            raise InvalidArgumentError(f"--metrics-config summary_quantiles={value}: '{pair}' is not "
                                       f"<quantile>:<error>, e.g. 0.9:0.01") from None
        if not (0.0 <= q <= 1.0 and 0.0 <= error <= 1.0):
            raise InvalidArgumentError(f"--metrics-config summary_quantiles={value}: '{pair}' is out of range; "
                                       f"quantile and error must lie in [0, 1]")
        quantiles.add(q)
    return tuple(sorted(quantiles))
