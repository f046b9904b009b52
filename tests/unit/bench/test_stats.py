"""Percentiles and throughput against latencies whose answers are known by hand."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.bench.stats import percentile, percentile_index, summarize, throughput_per_s


def test_percentiles_of_one_to_hundred_follow_perf_analyzers_rounding() -> None:
    # index = round(p/100 * (n-1)), halves up: p50 -> 49.5 -> 50 (value 51), p90 -> 89.1 -> 89 (value 90) ...
    summary = summarize(list(range(100, 0, -1)))  # unsorted on purpose
    assert summary is not None
    assert (summary.p50_ns, summary.p90_ns, summary.p95_ns, summary.p99_ns) == (51, 90, 95, 99)
    assert summary.count == 100
    assert summary.avg_ns == pytest.approx(50.5)
    assert summary.std_ns == pytest.approx(np.std(np.arange(1, 101)))


def test_a_single_latency_is_every_percentile() -> None:
    summary = summarize([7_000])
    assert summary is not None
    assert {summary.p50_ns, summary.p90_ns, summary.p95_ns, summary.p99_ns} == {7_000}
    assert summary.avg_ns == 7_000
    assert summary.std_ns == 0


def test_two_latencies_put_the_median_on_the_upper_one() -> None:
    # 0.5 * (2 - 1) + 0.5 = 1.0 -> index 1, as perf_analyzer's size_t conversion gives
    assert percentile([10, 20], 50) == 20
    assert percentile([10, 20], 49) == 10


def test_p0_and_p100_are_the_extremes() -> None:
    ordered = [1, 5, 9, 13]
    assert percentile(ordered, 0) == 1
    assert percentile(ordered, 100) == 13


def test_a_slow_tail_shows_in_p99_only() -> None:
    latencies = [1_000_000] * 980 + [50_000_000] * 20  # 2 % of requests take 50 ms
    summary = summarize(latencies)
    assert summary is not None
    assert summary.p50_ns == summary.p95_ns == 1_000_000
    assert summary.p99_ns == 50_000_000  # index round(0.99 * 999) = 989, inside the slow 2 %
    assert summary.as_ms() == pytest.approx({"avg": 1.98, "p50": 1.0, "p90": 1.0, "p95": 1.0, "p99": 50.0})


def test_a_tail_of_exactly_one_percent_stays_below_p99() -> None:
    # the slow 1 % sit at indexes 990..999; p99 is index 989 (perf_analyzer's rounding, not the nearest rank 990)
    summary = summarize([1_000_000] * 990 + [50_000_000] * 10)
    assert summary is not None
    assert summary.p99_ns == 1_000_000
    assert summary.avg_ns == pytest.approx(1_490_000)


def test_no_latencies_summarize_to_none_and_have_no_percentile() -> None:
    assert summarize([]) is None
    with pytest.raises(ValueError, match="no latencies"):
        percentile_index(0, 50)


def test_percentile_outside_zero_to_hundred_is_refused() -> None:
    with pytest.raises(ValueError, match="0..100"):
        percentile_index(10, 101)


def test_throughput_is_count_over_window_duration() -> None:
    assert throughput_per_s(1000, 2_000_000_000) == 500.0
    assert throughput_per_s(0, 1_000_000_000) == 0.0
    assert throughput_per_s(3, 1_500_000) == pytest.approx(2000.0)


def test_throughput_of_an_empty_window_is_refused() -> None:
    with pytest.raises(ValueError, match="> 0 ns"):
        throughput_per_s(5, 0)
