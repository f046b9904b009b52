"""Latency percentiles and throughput, computed as perf_analyzer computes them. Pure functions over nanoseconds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

PERCENTILES = (50, 90, 95, 99)
NS_PER_S = 1_000_000_000


def percentile_index(count: int, percentile: float) -> int:
    """perf_analyzer's nearest rank: the index round(p/100 * (count - 1)) into the sorted latencies, halves rounding
    up. p0 is the minimum, p100 the maximum."""
    if count < 1:
        raise ValueError("a percentile of no latencies is undefined")
    if not 0 <= percentile <= 100:
        raise ValueError(f"percentile must be within 0..100, got {percentile}")
    return int(percentile / 100.0 * (count - 1) + 0.5)


def percentile(sorted_ns: Sequence[int] | npt.NDArray[np.int64], p: float) -> int:
    """The p-th percentile of latencies already sorted in ascending order."""
    return int(sorted_ns[percentile_index(len(sorted_ns), p)])


def throughput_per_s(count: int, duration_ns: int) -> float:
    """Completed requests per second over a window: perf_analyzer's count / duration."""
    if duration_ns <= 0:
        raise ValueError(f"a window must last > 0 ns, got {duration_ns}")
    return count * NS_PER_S / duration_ns


@dataclass(frozen=True)
class LatencySummary:
    """Client-side latency of the requests one measurement counted, in nanoseconds."""

    count: int
    avg_ns: float
    std_ns: float
    p50_ns: int
    p90_ns: int
    p95_ns: int
    p99_ns: int

    def as_ms(self) -> dict[str, float]:
        return {"avg": self.avg_ns / 1e6, "p50": self.p50_ns / 1e6, "p90": self.p90_ns / 1e6,
                "p95": self.p95_ns / 1e6, "p99": self.p99_ns / 1e6}


def summarize(latencies_ns: Sequence[int] | npt.NDArray[np.int64]) -> LatencySummary | None:
    """Average, population standard deviation and p50/p90/p95/p99; None for no latencies."""
    if len(latencies_ns) == 0:
        return None
    ordered = np.sort(np.asarray(latencies_ns, dtype=np.int64))
    values = {p: percentile(ordered, p) for p in PERCENTILES}
    return LatencySummary(count=len(ordered), avg_ns=float(ordered.mean()), std_ns=float(ordered.std()),
                          p50_ns=values[50], p90_ns=values[90], p95_ns=values[95], p99_ns=values[99])
