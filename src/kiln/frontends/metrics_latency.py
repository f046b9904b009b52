"""Opt-in latency metrics fed per request: Triton's ``nv_inference_*_summary_us`` summaries and the
``nv_inference_first_response_histogram_ms`` histogram.

The request path pays one lock, one dict lookup and a deque append (summaries) or one bucket increment
(histogram) per successful request; quantiles are computed at scrape time.

Summary window: quantiles cover the requests that finished in the last ``window_s`` seconds (60 s, the
prometheus-cpp default Triton's summaries use), capped at the ``max_samples`` most recent requests per model
version (10,000) so memory stays bounded under heavy load. They are exact over that window (nearest rank), where
Triton's CKMS estimator is approximate within its error targets. A quantile with no request in the window is NaN,
as in Triton. ``_count`` and ``_sum`` are cumulative since the model was first seen.
"""

from __future__ import annotations

import bisect
import collections
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import Metric

from kiln.server.stats import RequestTimes

HISTOGRAM_NAME = "nv_inference_first_response_histogram_ms"
DEFAULT_BUCKETS_MS: tuple[float, ...] = (100.0, 500.0, 2000.0, 5000.0)
DEFAULT_QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.95, 0.99)
WINDOW_S = 60.0
MAX_SAMPLES = 10_000
_FOLD_EVERY = 1024  # samples kept unsummed at most, between scrapes

# Family name and help, in the order of RequestTimes' durations (request, queue, compute input/infer/output).
SUMMARIES: tuple[tuple[str, str], ...] = (
    ("nv_inference_request_summary_us", "Summary of inference request duration in microseconds"),
    ("nv_inference_queue_summary_us", "Summary of inference queuing duration in microseconds"),
    ("nv_inference_compute_input_summary_us", "Summary of compute input duration in microseconds"),
    ("nv_inference_compute_infer_summary_us", "Summary of compute inference duration in microseconds"),
    ("nv_inference_compute_output_summary_us", "Summary of inference compute output duration in microseconds"),
)

Clock = Callable[[], int]
BucketsFor = Callable[[str, str], Sequence[float]]
Key = tuple[str, str]  # (model, version)
_Sample = tuple[int, int, int, int, int, int]  # finished_ns, then the five durations in ns


@dataclass
class _Series:
    """One model version's latency state. Guarded by the recorder's lock."""

    window: collections.deque[_Sample]
    bounds: tuple[float, ...]
    created_ns: int
    count: int = 0  # samples folded into sums_ns
    sums_ns: list[int] = field(default_factory=lambda: [0] * len(SUMMARIES))
    unsummed: list[_Sample] = field(default_factory=list)  # added to count and sums_ns in bulk (fold)
    bucket_counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; the last is +Inf
    histogram_sum_ms: float = 0.0

    def __post_init__(self) -> None:
        self.bucket_counts = [0] * (len(self.bounds) + 1)

    def fold(self) -> None:
        if not self.unsummed:
            return
        columns = list(zip(*self.unsummed, strict=True))[1:]  # drop the finish times
        self.sums_ns = [total + sum(column) for total, column in zip(self.sums_ns, columns, strict=True)]
        self.count += len(self.unsummed)
        self.unsummed.clear()


@dataclass(frozen=True)
class _Snapshot:
    count: int
    sums_ns: tuple[int, ...]
    recent: tuple[_Sample, ...]
    bounds: tuple[float, ...]
    bucket_counts: tuple[int, ...]
    histogram_sum_ms: float


class LatencyRecorder:
    """A request observer (``Server.add_request_observer(recorder.observe)``) and the families it feeds."""

    def __init__(self, *, summaries: bool, histogram: bool, quantiles: Sequence[float] = DEFAULT_QUANTILES,
                 buckets_for: BucketsFor | None = None, window_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES,
                 clock: Clock = time.monotonic_ns) -> None:
        self.summaries = summaries
        self.histogram = histogram
        self.quantiles = tuple(quantiles)
        self._buckets_for = buckets_for or (lambda _model, _version: DEFAULT_BUCKETS_MS)
        self._window_ns = int(window_s * 1e9)
        self._max_samples = max_samples
        self.clock = clock
        self._lock = threading.Lock()
        self._series: dict[Key, _Series] = {}

    def observe(self, times: RequestTimes) -> None:
        """Record one successful request. Runs on a worker thread for every request: keep it cheap."""
        key = (times.model, times.version)
        series = self._series.get(key) or self._add_series(key)
        sample = (self.clock(), times.request_ns, times.queue_ns, times.compute_input_ns, times.compute_infer_ns,
                  times.compute_output_ns) if self.summaries else None
        with self._lock:
            if sample is not None:
                series.window.append(sample)
                series.unsummed.append(sample)
                if len(series.unsummed) >= _FOLD_EVERY:
                    series.fold()
            if self.histogram:
                ms = times.request_ns / 1e6  # non-decoupled models: the first response is the only one
                series.bucket_counts[bisect.bisect_left(series.bounds, ms)] += 1
                series.histogram_sum_ms += ms

    def families(self, keys: Iterable[Key], listed_ns: int) -> Iterator[Metric]:
        """The enabled families with one series per (model, version) in ``keys``: the versions loaded at
        ``listed_ns`` (this recorder's clock). Series of other versions are dropped unless first seen after."""
        loaded = list(keys)
        self._prune(set(loaded), listed_ns)
        snapshots = {key: self._snapshot(key) for key in loaded}
        if self.summaries:
            yield from self._summary_families(snapshots)
        if self.histogram:
            yield _histogram_family(snapshots)

    def _add_series(self, key: Key) -> _Series:
        bounds = _clean_bounds(self._buckets_for(*key))  # outside the lock: it may read the model's config
        fresh = _Series(window=collections.deque(maxlen=self._max_samples), bounds=bounds, created_ns=self.clock())
        with self._lock:
            return self._series.setdefault(key, fresh)

    def _prune(self, loaded: set[Key], began_ns: int) -> None:
        with self._lock:
            for key in [k for k, series in self._series.items() if k not in loaded and series.created_ns < began_ns]:
                del self._series[key]

    def _snapshot(self, key: Key) -> _Snapshot:
        series = self._series.get(key) or self._add_series(key)
        oldest = self.clock() - self._window_ns
        with self._lock:
            window = series.window
            while window and window[0][0] < oldest:
                window.popleft()
            series.fold()
            return _Snapshot(series.count, tuple(series.sums_ns), tuple(window), series.bounds,
                             tuple(series.bucket_counts), series.histogram_sum_ms)

    def _summary_families(self, snapshots: dict[Key, _Snapshot]) -> Iterator[Metric]:
        for index, (name, help_text) in enumerate(SUMMARIES):
            family = Metric(name, help_text, "summary")
            for (model, version), snap in snapshots.items():
                labels = {"model": model, "version": version}
                ordered = sorted(sample[index + 1] for sample in snap.recent)
                for q in self.quantiles:
                    family.add_sample(name, {**labels, "quantile": format_bound(q)}, quantile_us(ordered, q))
                family.add_sample(f"{name}_count", labels, snap.count)
                family.add_sample(f"{name}_sum", labels, snap.sums_ns[index] / 1000)
            yield family


def _histogram_family(snapshots: dict[Key, _Snapshot]) -> Metric:
    family = Metric(HISTOGRAM_NAME, "Duration from request to first response in milliseconds", "histogram")
    for (model, version), snap in snapshots.items():
        labels = {"model": model, "version": version}
        cumulative = 0
        for bound, count in zip((*snap.bounds, math.inf), snap.bucket_counts, strict=True):
            cumulative += count
            family.add_sample(f"{HISTOGRAM_NAME}_bucket", {**labels, "le": format_bound(bound)}, cumulative)
        family.add_sample(f"{HISTOGRAM_NAME}_count", labels, cumulative)
        family.add_sample(f"{HISTOGRAM_NAME}_sum", labels, snap.histogram_sum_ms)
    return family


def quantile_us(ordered_ns: Sequence[int], q: float) -> float:
    """The nearest-rank ``q`` quantile of sorted nanosecond durations, in microseconds; NaN when empty."""
    if not ordered_ns:
        return math.nan
    rank = max(1, math.ceil(q * len(ordered_ns)))
    return ordered_ns[min(rank, len(ordered_ns)) - 1] / 1000


def format_bound(value: float) -> str:
    """A label value as Triton (prometheus-cpp) writes it: ``100`` rather than ``100.0``, ``+Inf``."""
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _clean_bounds(bounds: Sequence[float]) -> tuple[float, ...]:
    cleaned = tuple(sorted({float(b) for b in bounds if math.isfinite(b)}))
    return cleaned or DEFAULT_BUCKETS_MS
