"""Prometheus metrics against a real Server: Triton's names, types and labels, every counter checked against the
statistics, failures by reason, opt-in summaries and histogram, host and GPU metrics, --metrics-config, and the
Grafana dashboard's queries."""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import psutil
import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from kiln.config.spec import ModelSpec
from kiln.demo import build_demo_repository
from kiln.engines import Engine, EngineOptions, register_backend
from kiln.engines.base import Array
from kiln.errors import InternalError, InvalidArgumentError, QueueFullError
from kiln.frontends import metrics_gpu
from kiln.frontends.metrics import MetricsOptions, metrics_registry, parse_metrics_config, render_metrics
from kiln.frontends.metrics_cpu import CpuCollector
from kiln.frontends.metrics_gpu import GpuCollector, gpu_collector, import_nvml, visible
from kiln.frontends.metrics_latency import LatencyRecorder
from kiln.server import InferRequest, InputTensor, Server, ServerOptions
from kiln.server.stats import RequestTimes
from kiln.tensor import DataType

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
MODEL_LABELS = {"model", "version"}
COUNTERS = ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
            "nv_inference_exec_count")
DURATIONS = ("nv_inference_request_duration_us", "nv_inference_queue_duration_us",
             "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
             "nv_inference_compute_output_duration_us")
SUMMARIES = ("nv_inference_request_summary_us", "nv_inference_queue_summary_us",
             "nv_inference_compute_input_summary_us", "nv_inference_compute_infer_summary_us",
             "nv_inference_compute_output_summary_us")
HISTOGRAM = "nv_inference_first_response_histogram_ms"
CPU = ("nv_cpu_utilization", "nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes")
GPU_GAUGES = ("nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes", "nv_gpu_power_usage",
              "nv_gpu_power_limit")
NO_GPU = MetricsOptions(gpu_metrics=False)

GATE = threading.Event()  # open unless a test holds the gated model's executions
GATE.set()
ENTERED = threading.Event()


class GatedEngine(Engine):
    """Identity on "x"; waits for GATE; fails (a BACKEND failure) on a negative input."""

    def __init__(self, spec: ModelSpec, model_file: Path, options: EngineOptions) -> None:
        super().__init__(spec)

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        if (inputs["x"] < 0).any():
            raise RuntimeError("negative input")
        ENTERED.set()
        GATE.wait(30)
        return {"y": inputs["x"]}


GATED_CONFIG = """
backend: "gated_for_metrics_test" max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
dynamic_batching { default_queue_policy { max_queue_size: 1 } }
"""

BUCKETS_CONFIG = """
backend: "identity" max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
model_metrics { metric_control [ {
  metric_identifier { family: "nv_inference_first_response_histogram_ms" }
  histogram_options { buckets: [ 10, 1, 250.5 ] }
} ] }
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    register_backend("gated_for_metrics_test", GatedEngine)
    root = tmp_path_factory.mktemp("repo")
    build_demo_repository(root)
    for name, config in (("gated", GATED_CONFIG), ("bucketed", BUCKETS_CONFIG)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
    return root


@pytest.fixture
def server(repo: Path) -> Iterator[Server]:
    server = Server(ServerOptions(repositories=[repo]))
    server.start()
    yield server
    GATE.set()
    server.close()


# -- helpers -----------------------------------------------------------------------------------------------------

def simple_request(batch: int = 1) -> InferRequest:
    a = np.arange(16 * batch, dtype=np.int32).reshape(batch, 16)
    return InferRequest("simple", [InputTensor("INPUT0", DataType.INT32, a.shape, a),
                                   InputTensor("INPUT1", DataType.INT32, a.shape, a)])


def xy_request(model: str, value: float, batch: int = 1) -> InferRequest:
    x = np.full((batch, 2), value, np.float32)
    return InferRequest(model, [InputTensor("x", DataType.FP32, x.shape, x)])


def mlp_request(batch: int = 1) -> InferRequest:
    x = np.random.default_rng(batch).standard_normal((batch, 64)).astype(np.float32)
    return InferRequest("mlp", [InputTensor("INPUT0", DataType.FP32, x.shape, x)])


class Scrape:
    """One exposition, parsed with prometheus_client's parser. Counter samples are keyed by their exposed name
    (the parser itself reports them as ``<name>_total``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.text = render_metrics(registry).decode()
        self.types: dict[str, str] = {}
        self.samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(self.text):
            self.types[family.name] = family.type
            for sample in family.samples:
                name = sample.name.removesuffix("_total") if family.type == "counter" else sample.name
                self.samples.setdefault(name, []).append((sample.labels, sample.value))

    def value(self, name: str, **labels: str) -> float:
        found = [v for sample_labels, v in self.samples.get(name, []) if labels.items() <= sample_labels.items()]
        assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
        return found[0]

    def label_sets(self, name: str) -> list[set[str]]:
        return [set(labels) for labels, _ in self.samples.get(name, [])]

    def no_total_suffix(self) -> bool:
        """No sample or family name ends in ``_total`` (nv_cpu_memory_total_bytes is fine)."""
        return re.search(r"_total[{ ]", self.text) is None

    def sample_names(self) -> set[str]:
        return {line.split("{")[0].split(" ")[0] for line in self.text.splitlines() if line and line[0] != "#"}


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.002)


# -- model counters ----------------------------------------------------------------------------------------------

def test_counters_match_the_statistics(server: Server) -> None:
    registry = metrics_registry(server, NO_GPU)
    for batch in (1, 3, 8):
        server.infer_sync(simple_request(batch))
    for batch in (2, 5):
        server.infer_sync(mlp_request(batch))
    scrape = Scrape(registry)
    stats = server.model_statistics()
    assert {(s.name, s.version) for s in stats} == {("simple", "1"), ("mlp", "1"), ("simple_string", "1"),
                                                    ("gated", "1"), ("bucketed", "1"), ("mlp_pipeline", "1"),
                                                    ("mlp_preprocess", "1"), ("mlp_postprocess", "1"),
                                                    ("simple_int8", "1"), ("simple_sequence", "1"),
                                                    ("simple_dyna_sequence", "1"), ("simple_identity", "1"),
                                                    ("image_classifier", "1"), ("simple_string_dyna_sequence", "1"),
                                                    ("repeat_int32", "1")}
    for s in stats:
        labels = {"model": s.name, "version": s.version}
        assert scrape.value("nv_inference_request_success", **labels) == s.success.count
        assert scrape.value("nv_inference_count", **labels) == s.inference_count
        assert scrape.value("nv_inference_exec_count", **labels) == s.execution_count
        for name, duration in zip(DURATIONS, (s.success, s.queue, s.compute_input, s.compute_infer,
                                              s.compute_output), strict=True):
            assert scrape.value(name, **labels) == duration.ns // 1000
        for reason in ("REJECTED", "CANCELED", "BACKEND", "OTHER"):
            assert scrape.value("nv_inference_request_failure", reason=reason, **labels) == 0
        assert scrape.value("nv_inference_pending_request_count", **labels) == 0
        assert scrape.value("nv_model_load_duration_secs", **labels) == pytest.approx(s.load_duration_s)
        assert s.load_duration_s > 0
    simple = {"model": "simple", "version": "1"}
    assert (scrape.value("nv_inference_request_success", **simple), scrape.value("nv_inference_count", **simple),
            scrape.value("nv_inference_exec_count", **simple)) == (3, 12, 3)
    assert scrape.value("nv_inference_compute_infer_duration_us", **simple) > 0


def test_exposition_has_triton_names_types_and_labels(server: Server) -> None:
    server.infer_sync(simple_request())
    scrape = Scrape(metrics_registry(server, NO_GPU))
    assert scrape.no_total_suffix()
    for name in (*COUNTERS, *DURATIONS):
        assert scrape.types[name] == "counter"
        assert f"# TYPE {name} counter" in scrape.text.splitlines()
        expected = MODEL_LABELS | {"reason"} if name == "nv_inference_request_failure" else MODEL_LABELS
        assert all(labels == expected for labels in scrape.label_sets(name)), name
    for name in ("nv_inference_pending_request_count", "nv_model_load_duration_secs", *CPU):
        assert scrape.types[name] == "gauge"
    ensemble_steps = {"kiln_ensemble_step_success", "kiln_ensemble_step_failure", "kiln_ensemble_step_duration_us"}
    for name in ensemble_steps:  # the demo pipeline's three steps
        assert scrape.types[name] == "counter"
        assert scrape.label_sets(name) == [{"model", "version", "step", "step_model"}] * 3
    joined = {"kiln_inference_joined_request_success", "kiln_inference_joined_member_success",
              "kiln_inference_held_member_success"}
    for name in joined:  # per model version; nothing joined without worker processes
        assert scrape.types[name] == "counter"
        assert all(labels == MODEL_LABELS for labels in scrape.label_sets(name)), name
        assert {value for _, value in scrape.samples[name]} == {0}
    assert scrape.sample_names() == {*COUNTERS, *DURATIONS, "nv_inference_pending_request_count",
                                     "nv_model_load_duration_secs", *CPU, *ensemble_steps, *joined}
    assert len(scrape.samples["nv_inference_request_failure"]) == 4 * len(server.model_statistics())


def test_counter_latencies_can_be_turned_off(server: Server) -> None:
    server.infer_sync(simple_request())
    scrape = Scrape(metrics_registry(server, MetricsOptions(counter_latencies=False, gpu_metrics=False)))
    assert not any(name in scrape.types for name in DURATIONS)
    assert scrape.value("nv_inference_request_success", model="simple", version="1") == 1


def test_failures_are_counted_by_reason_and_pending_requests_shown(server: Server) -> None:
    registry = metrics_registry(server, NO_GPU)
    gated = {"model": "gated", "version": "1"}
    GATE.clear()
    ENTERED.clear()
    with ThreadPoolExecutor(max_workers=2) as pool:
        try:
            first = pool.submit(server.infer_sync, xy_request("gated", 1.0))
            assert ENTERED.wait(10)  # the first request runs; the queue is empty again
            second = pool.submit(server.infer_sync, xy_request("gated", 2.0))
            wait_until(lambda: server.pending("gated", "1") == 2)  # the second one waits in the queue (size 1)
            with pytest.raises(QueueFullError):
                server.infer_sync(xy_request("gated", 3.0))
            held = Scrape(registry)
        finally:
            GATE.set()
        assert first.result(10).outputs[0].data[0, 0] == 1.0
        assert second.result(10).outputs[0].data[0, 0] == 2.0
    assert held.value("nv_inference_pending_request_count", **gated) == 2
    assert held.value("nv_inference_request_failure", reason="REJECTED", **gated) == 1
    assert held.value("nv_inference_request_failure", reason="BACKEND", **gated) == 0
    with pytest.raises(InternalError, match="negative input"):
        server.infer_sync(xy_request("gated", -1.0))
    after = Scrape(registry)
    expected = {"REJECTED": 1, "CANCELED": 0, "BACKEND": 1, "OTHER": 0}
    assert {r: after.value("nv_inference_request_failure", reason=r, **gated) for r in expected} == expected
    stats = server.model_statistics("gated")[0]
    assert stats.fail.count == 2 and stats.failures_by_reason == {"REJECTED": 1, "BACKEND": 1}
    assert after.value("nv_inference_request_success", **gated) == stats.success.count == 2
    assert after.value("nv_inference_pending_request_count", **gated) == 0
    assert after.value("nv_inference_request_failure", reason="REJECTED", model="simple", version="1") == 0


# -- opt-in latencies --------------------------------------------------------------------------------------------

def test_summaries_and_histogram_are_absent_by_default(server: Server) -> None:
    server.infer_sync(simple_request())
    scrape = Scrape(metrics_registry(server, NO_GPU))
    for name in (*SUMMARIES, HISTOGRAM):
        assert name not in scrape.types and name not in scrape.text


def test_summaries_and_histogram_when_enabled(server: Server) -> None:
    options = MetricsOptions(summary_latencies=True, histogram_latencies=True, gpu_metrics=False)
    registry = metrics_registry(server, options)

    async def load() -> None:  # concurrent requests: the dynamic batcher forms batches on worker threads
        await asyncio.gather(*(server.infer(mlp_request(1 + i % 3)) for i in range(48)))

    asyncio.run(load())
    for batch in (1, 2):
        server.infer_sync(simple_request(batch))
    scrape = Scrape(registry)
    for s in server.model_statistics():
        labels = {"model": s.name, "version": s.version}
        totals = (s.success.ns, s.queue.ns, s.compute_input.ns, s.compute_infer.ns, s.compute_output.ns)
        for name, total_ns in zip(SUMMARIES, totals, strict=True):
            assert scrape.types[name] == "summary"
            assert scrape.value(f"{name}_count", **labels) == s.success.count
            assert scrape.value(f"{name}_sum", **labels) == pytest.approx(total_ns / 1000)
            quantiles = [scrape.value(name, quantile=q, **labels) for q in ("0.5", "0.9", "0.95", "0.99")]
            if s.success.count:
                assert all(0 <= a <= b for a, b in zip(quantiles, quantiles[1:], strict=False))
            else:
                assert all(math.isnan(q) for q in quantiles)
        assert scrape.types[HISTOGRAM] == "histogram"
        assert scrape.value(f"{HISTOGRAM}_count", **labels) == s.success.count
        assert scrape.value(f"{HISTOGRAM}_sum", **labels) == pytest.approx(s.success.ns / 1e6)
    mlp = {"model": "mlp", "version": "1"}
    assert scrape.value("nv_inference_request_summary_us_count", **mlp) == 48
    p99 = scrape.value("nv_inference_request_summary_us", quantile="0.99", **mlp)
    assert 0 < p99 <= scrape.value("nv_inference_request_summary_us_sum", **mlp)
    buckets = [(labels["le"], v) for labels, v in scrape.samples[f"{HISTOGRAM}_bucket"] if labels["model"] == "mlp"]
    assert [le for le, _ in buckets] == ["100", "500", "2000", "5000", "+Inf"]
    assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1][1] == 48
    assert {frozenset(labels) for labels, _ in scrape.samples[f"{HISTOGRAM}_bucket"]} == {
        frozenset({"model", "version", "le"})}


def test_quantiles_from_metrics_config(server: Server) -> None:
    options = parse_metrics_config(["summary_latencies=true", "summary_quantiles=0.25:0.01,0.75:0.01"])
    registry = metrics_registry(server, options)
    server.infer_sync(simple_request())
    scrape = Scrape(registry)
    quantiles = {labels["quantile"] for labels, _ in scrape.samples["nv_inference_queue_summary_us"]}
    assert quantiles == {"0.25", "0.75"}
    assert HISTOGRAM not in scrape.types


def test_histogram_buckets_follow_the_model_metrics_override(server: Server) -> None:
    registry = metrics_registry(server, MetricsOptions(histogram_latencies=True, gpu_metrics=False))
    server.infer_sync(xy_request("bucketed", 1.0))
    scrape = Scrape(registry)
    bounds = [labels["le"] for labels, _ in scrape.samples[f"{HISTOGRAM}_bucket"] if labels["model"] == "bucketed"]
    assert bounds == ["1", "10", "250.5", "+Inf"]


class FakeClock:
    def __init__(self) -> None:
        self.ns = 1_000_000_000_000

    def __call__(self) -> int:
        return self.ns


def times(request_us: int, model: str = "m") -> RequestTimes:
    ns = request_us * 1000
    return RequestTimes(model, "1", ns, ns // 2, 1000, ns // 4, 2000)


def test_summary_window_is_the_last_60_seconds_and_bounded() -> None:
    clock = FakeClock()
    recorder = LatencyRecorder(summaries=True, histogram=False, quantiles=(0.0, 0.5, 1.0), clock=clock,
                               max_samples=100)

    def families() -> dict[str, list[Any]]:
        return {m.name: m.samples for m in recorder.families([("m", "1")], clock())}

    for us in range(1, 11):  # 1..10 us
        recorder.observe(times(us))
    request = families()["nv_inference_request_summary_us"]
    quantile = {s.labels["quantile"]: s.value for s in request if "quantile" in s.labels}
    assert quantile == {"0": 1.0, "0.5": 5.0, "1": 10.0}  # nearest rank
    clock.ns += 61 * 10**9
    recorder.observe(times(1000))
    request = families()["nv_inference_request_summary_us"]
    assert {s.value for s in request if "quantile" in s.labels} == {1000.0}  # older samples left the window
    assert [s.value for s in request if s.name.endswith("_count")] == [11]  # _count and _sum stay cumulative
    assert [s.value for s in request if s.name.endswith("_sum")] == [55 + 1000]
    for us in range(200):
        recorder.observe(times(us))
    request = families()["nv_inference_request_summary_us"]
    assert {s.labels["quantile"]: s.value for s in request if "quantile" in s.labels}["0"] == 100.0  # last 100
    for _ in range(3000):  # sums are added up in bulk every so often: nothing is lost on the way
        recorder.observe(times(2))
    request = families()["nv_inference_request_summary_us"]
    assert [s.value for s in request if s.name.endswith("_count")] == [11 + 200 + 3000]
    assert [s.value for s in request if s.name.endswith("_sum")] == [1055 + sum(range(200)) + 6000]


def test_series_of_unloaded_versions_are_dropped() -> None:
    clock = FakeClock()
    recorder = LatencyRecorder(summaries=True, histogram=True, clock=clock)
    recorder.observe(times(5, "old"))
    clock.ns += 1
    names = {s.labels["model"] for m in recorder.families([("new", "1")], clock()) for s in m.samples}
    assert names == {"new"}
    recorder.observe(times(5, "late"))  # first seen after the model list was read: kept
    names = {s.labels["model"] for m in recorder.families([("new", "1")], clock.ns - 1) for s in m.samples}
    assert names == {"new"}
    assert {s.labels["model"] for m in recorder.families([("late", "1")], clock()) for s in m.samples} == {"late"}


# -- host and GPU metrics -----------------------------------------------------------------------------------------

def test_cpu_metrics_are_present_and_sane(server: Server) -> None:
    scrape = Scrape(metrics_registry(server, NO_GPU))
    assert 0.0 <= scrape.value("nv_cpu_utilization") <= 1.0
    total, used = scrape.value("nv_cpu_memory_total_bytes"), scrape.value("nv_cpu_memory_used_bytes")
    assert total == psutil.virtual_memory().total and 0 < used < total
    assert all(labels == set() for name in CPU for labels in scrape.label_sets(name))
    off = Scrape(metrics_registry(server, MetricsOptions(cpu_metrics=False, gpu_metrics=False)))
    assert not any(name in off.types for name in CPU)


def test_cpu_utilization_is_busy_over_busy_plus_idle_between_scrapes() -> None:
    readings = iter([
        SimpleNamespace(user=10.0, nice=0.0, system=5.0, idle=80.0, iowait=5.0, irq=0.0, softirq=0.0, steal=0.0,
                        guest=3.0),
        SimpleNamespace(user=40.0, nice=0.0, system=15.0, idle=100.0, iowait=15.0, irq=0.0, softirq=0.0, steal=0.0,
                        guest=30.0),
        SimpleNamespace(user=40.0, nice=0.0, system=15.0, idle=100.0, iowait=15.0, irq=0.0, softirq=0.0, steal=0.0,
                        guest=30.0),
    ])
    memory = SimpleNamespace(total=1000, available=250, used=1)
    collector = CpuCollector(cpu_times=lambda: next(readings), virtual_memory=lambda: memory)
    values = {m.name: m.samples[0].value for m in collector.collect()}
    # busy 40 of 70 (guest is inside user); used = total - available, not psutil's own "used"
    assert values == {"nv_cpu_utilization": pytest.approx(40 / 70), "nv_cpu_memory_total_bytes": 1000,
                      "nv_cpu_memory_used_bytes": 750}
    assert collector.utilization() == pytest.approx(40 / 70)  # no tick since: the last value


class FakeNvml:
    """pynvml's surface as metrics_gpu uses it: two GPUs, the second without power readings."""

    class NVMLError(Exception):
        pass

    def __init__(self, fail_init: bool = False) -> None:
        self.fail_init = fail_init
        self.energy_mj = [1_000_000, 5_000_000]

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str | bytes:
        uuids: list[str | bytes] = ["GPU-aaaa-1111", b"GPU-bbbb-2222"]  # older pynvml returns bytes
        return uuids[handle]

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=[35, 100][handle], memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(total=80 * 2**30, used=[2**30, 0][handle], free=0)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        if handle == 1:
            raise self.NVMLError("Not Supported")
        return 123_500

    def nvmlDeviceGetPowerManagementLimit(self, handle: int) -> int:
        if handle == 1:
            raise self.NVMLError("Not Supported")
        return 700_000

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        self.energy_mj[handle] += 2500
        return self.energy_mj[handle]


def scrape_collector(collector: GpuCollector) -> Scrape:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return Scrape(registry)


def test_gpu_metrics_from_nvml_readings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    collector = gpu_collector(FakeNvml())  # type: ignore[arg-type]
    assert collector is not None and collector.uuids == ["GPU-aaaa-1111", "GPU-bbbb-2222"]
    scrape = scrape_collector(collector)
    a, b = {"gpu_uuid": "GPU-aaaa-1111"}, {"gpu_uuid": "GPU-bbbb-2222"}
    assert (scrape.value("nv_gpu_utilization", **a), scrape.value("nv_gpu_utilization", **b)) == (0.35, 1.0)
    assert scrape.value("nv_gpu_memory_total_bytes", **a) == 80 * 2**30
    assert scrape.value("nv_gpu_memory_used_bytes", **a) == 2**30
    assert (scrape.value("nv_gpu_power_usage", **a), scrape.value("nv_gpu_power_limit", **a)) == (123.5, 700.0)
    assert [labels for labels, _ in scrape.samples["nv_gpu_power_usage"]] == [a]  # not supported on b: left out
    assert scrape.value("nv_energy_consumption", **a) == 2.5  # joules since the collector started
    assert scrape.types["nv_energy_consumption"] == "counter" and scrape.no_total_suffix()
    assert all(scrape.types[name] == "gauge" for name in GPU_GAUGES)
    assert all(labels == {"gpu_uuid"} for name in scrape.samples for labels in scrape.label_sets(name))


def test_gpu_metrics_follow_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb")
    collector = gpu_collector(FakeNvml())  # type: ignore[arg-type]
    assert collector is not None and collector.uuids == ["GPU-bbbb-2222"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_collector(FakeNvml()) is None  # type: ignore[arg-type]
    assert visible(1, "GPU-x", "0, 1") and not visible(1, "GPU-x", "0") and visible(3, "GPU-x", None)


def test_gpu_metrics_are_absent_without_nvml_or_a_gpu(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    assert gpu_collector(FakeNvml(fail_init=True)) is None  # type: ignore[arg-type]
    monkeypatch.setattr(metrics_gpu, "import_nvml", lambda: None)
    scrape = Scrape(metrics_registry(server))
    assert not any(name.startswith(("nv_gpu_", "nv_energy")) for name in scrape.types)
    assert "nv_cpu_utilization" in scrape.types
    monkeypatch.setattr(metrics_gpu, "import_nvml", lambda: FakeNvml())
    assert "nv_gpu_utilization" in Scrape(metrics_registry(server)).types
    assert "nv_gpu_utilization" not in Scrape(metrics_registry(server, NO_GPU)).types


@pytest.mark.gpu
def test_gpu_metrics_through_real_nvml(server: Server) -> None:
    if import_nvml() is None:
        pytest.skip("pynvml (package nvidia-ml-py) is not installed")
    collector = gpu_collector()
    if collector is None:
        pytest.skip("NVML is not usable here: no NVIDIA driver or no visible GPU")
    scrape = Scrape(metrics_registry(server))
    for uuid in collector.uuids:
        assert uuid.startswith(("GPU-", "MIG-"))
        assert 0.0 <= scrape.value("nv_gpu_utilization", gpu_uuid=uuid) <= 1.0
        total = scrape.value("nv_gpu_memory_total_bytes", gpu_uuid=uuid)
        assert 0 < scrape.value("nv_gpu_memory_used_bytes", gpu_uuid=uuid) <= total
        if "nv_gpu_power_usage" in scrape.samples:
            assert 0 < scrape.value("nv_gpu_power_usage", gpu_uuid=uuid) <= 2 * scrape.value(
                "nv_gpu_power_limit", gpu_uuid=uuid)
        if "nv_energy_consumption" in scrape.samples:
            assert scrape.value("nv_energy_consumption", gpu_uuid=uuid) >= 0


# -- exposition, --metrics-config, dashboard ----------------------------------------------------------------------

def test_render_keeps_real_total_counters() -> None:
    registry = CollectorRegistry()
    Counter("requests", "Requests", registry=registry).inc(3)
    text = render_metrics(registry).decode()
    assert "# TYPE requests_total counter" in text and "requests_total 3.0" in text


def test_parse_metrics_config() -> None:
    assert parse_metrics_config([]) == MetricsOptions()
    options = parse_metrics_config(["counter_latencies=false", "summary_latencies=true", "histogram_latencies=1",
                                    "summary_quantiles=0.99:0.001, 0.5:0.05,0.9:0.01", "summary_latencies=On"])
    assert options == MetricsOptions(counter_latencies=False, summary_latencies=True, histogram_latencies=True,
                                     summary_quantiles=(0.5, 0.9, 0.99))
    assert parse_metrics_config(["summary_quantiles=0.5"]).summary_quantiles == (0.5,)
    with pytest.raises(InvalidArgumentError, match=r"summary quantiles \[99\.0\] are out of range"):
        MetricsOptions(summary_quantiles=(0.5, 99.0))


@pytest.mark.parametrize(("item", "fragments"), [
    ("summary_latency=true", ["unknown key 'summary_latency'", "summary_latencies"]),
    ("summary_latencies", ["'summary_latencies'", "expected key=value"]),
    ("=true", ["expected key=value"]),
    ("counter_latencies=maybe", ["counter_latencies=maybe", "expected true or false"]),
    ("summary_quantiles=0.5:x", ["'0.5:x'", "<quantile>:<error>"]),
    ("summary_quantiles=", ["summary_quantiles=", "<quantile>:<error>"]),
    ("summary_quantiles=1.5:0.01", ["'1.5:0.01'", "[0, 1]"]),
])
def test_parse_metrics_config_rejects_bad_items(item: str, fragments: list[str]) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        parse_metrics_config([item])
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_grafana_dashboard_queries_only_metrics_kiln_exposes(server: Server,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_gpu, "import_nvml", lambda: FakeNvml())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    options = MetricsOptions(summary_latencies=True, histogram_latencies=True)
    exposed = Scrape(metrics_registry(server, options)).sample_names()
    dashboard = json.loads(DASHBOARD.read_text())
    assert any(v["type"] == "datasource" and v["query"] == "prometheus" for v in dashboard["templating"]["list"])
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    used: set[str] = set()
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\bnv_[a-z0-9_]+", target["expr"]))
            assert names and names <= exposed, (panel["title"], names - exposed)
            used |= names
    titles = " | ".join(p["title"].lower() for p in panels)
    for topic in ("request rate", "inference rate", "batch size", "latency breakdown", "pending",
                  "load duration", "cpu utilization", "cpu memory", "gpu utilization", "gpu memory"):
        assert topic in titles
    assert {*COUNTERS, *DURATIONS, "nv_inference_pending_request_count", "nv_model_load_duration_secs", *CPU,
            "nv_gpu_utilization", "nv_gpu_memory_used_bytes"} <= used
