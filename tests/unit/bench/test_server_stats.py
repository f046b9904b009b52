"""Server-side breakdown: statistics-extension counters, their differences and per-request averages."""

from __future__ import annotations

import pytest

from kiln.bench.server_stats import Duration, ServerCounters, add_counters, counters_from_doc


def stats_entry(name: str, version: str, success: int, queue_ns: int, infer_ns: int) -> dict[str, object]:
    return {"name": name, "version": version, "inference_stats": {
        "success": {"count": success, "ns": success * 1000}, "fail": {"count": 0, "ns": 0},
        "queue": {"count": success, "ns": queue_ns}, "compute_input": {"count": success, "ns": 0},
        "compute_infer": {"count": str(success), "ns": str(infer_ns)},  # gRPC's JSON writes uint64 as strings
        "compute_output": {"count": success, "ns": success * 10}}}


def test_counters_sum_every_version_of_the_model_only() -> None:
    doc = {"model_stats": [stats_entry("simple", "1", 10, 5_000, 90_000),
                           stats_entry("simple", "2", 30, 15_000, 10_000),
                           stats_entry("other", "1", 99, 1, 1)]}
    counters = counters_from_doc(doc, "simple")
    assert counters.success == 40
    assert counters.phase("queue") == Duration(40, 20_000)
    assert counters.phase("compute_infer") == Duration(40, 100_000)


def test_difference_of_counters_gives_per_request_microseconds() -> None:
    before = counters_from_doc({"model_stats": [stats_entry("m", "1", 100, 1_000_000, 5_000_000)]}, "m")
    after = counters_from_doc({"model_stats": [stats_entry("m", "1", 300, 3_000_000, 25_000_000)]}, "m")
    window = after - before
    assert window.success == 200
    assert window.per_request_us() == pytest.approx(
        {"queue": 10.0, "compute_input": 0.0, "compute_infer": 100.0, "compute_output": 0.01})


def test_no_requests_average_to_zero_and_missing_stats_are_empty() -> None:
    assert ServerCounters().per_request_us() == dict.fromkeys(
        ("queue", "compute_input", "compute_infer", "compute_output"), 0.0)
    assert counters_from_doc({}, "m") == add_counters([])
    assert counters_from_doc({"model_stats": [{"name": "m", "inference_stats": {"queue": None}}]}, "m").success == 0
