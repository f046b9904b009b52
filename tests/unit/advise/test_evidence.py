"""Evidence derived from synthetic `kiln bench compare` results shaped like the reference experiment."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kiln.advise.compare_file import load_compare, parse_compare
from kiln.advise.evidence import Evidence, derive
from kiln.advise.inputs import Inputs


def evidence_of(data: dict[str, Any], **inputs: Any) -> Evidence:
    return derive(parse_compare(data, Path("compare.json")), Inputs(**inputs))


def test_throughput_ratio_per_concurrency_matches_the_reference_shape(compare: dict[str, Any]) -> None:
    evidence = evidence_of(compare)
    served = evidence.throughput_ratio["served"]
    assert served == pytest.approx({1: 310 / 320, 8: 2600 / 2800, 16: 3200 / 3500})
    # The reference claim: direct calls are 5-10% faster than one-model serving.
    assert all(0.90 <= ratio <= 0.97 for ratio in served.values())
    assert evidence.throughput_ratio["served with 3 models"][16] == pytest.approx(2700 / 3500)
    assert "  c=8: direct 2,800/s, served 2,600/s = 0.93x, served with 3 models 2,200/s = 0.79x" in \
        evidence.lines


def test_p99_lines_say_which_path_meets_the_budget(compare: dict[str, Any]) -> None:
    evidence = evidence_of(compare, latency_budget_ms=5.0)
    assert "p99 latency by concurrency (budget 5 ms):" in evidence.lines
    assert "  c=8: direct 4.00 ms meets, served 4.60 ms meets, served with 3 models 5.50 ms misses" in evidence.lines


def test_memory_per_extra_model_is_the_peak_difference_over_the_extra_models(compare: dict[str, Any]) -> None:
    evidence = evidence_of(compare)
    assert evidence.per_extra_model_mb == pytest.approx((4100 - 3100) / 2)
    assert evidence.memory_totals_mb(3) == pytest.approx((3 * 2800, 3100 + 2 * 500))
    assert evidence.memory_totals_mb(1) is None
    assert "memory per extra model in the server: 500 MB" in evidence.lines


def test_memory_falls_back_to_the_per_row_samples(compare: dict[str, Any]) -> None:
    del compare["memory_mb"]
    for item, (idle, peaks) in zip(compare["scenarios"], [(1000, (2000, 2500, 2600)), (1500, (2900, 3000, 3050)),
                                                          (2200, (3600, 3900, 4050))], strict=True):
        for row, peak in zip(item["results"], peaks, strict=True):
            row["memory_mb"].update(rss_idle=idle, rss_peak=peak)
    evidence = evidence_of(compare)
    assert evidence.direct_peak_mb == 2600 and evidence.served_peak_mb == 3050
    assert evidence.per_extra_model_mb == pytest.approx((4050 - 3050) / 2)
    assert any("from per-row samples" in line for line in evidence.lines)


def test_missing_memory_is_named_not_fatal(compare: dict[str, Any]) -> None:
    del compare["memory_mb"]
    evidence = evidence_of(compare)
    assert evidence.per_extra_model_mb is None
    assert {"memory_mb.direct", "memory_mb.served", "memory_mb.served_with_others"} <= set(evidence.missing)
    assert "memory: not measured" in evidence.lines


@pytest.mark.parametrize(("with_batching", "word"), [(1.35, "helped"), (1.05, "within noise"), (0.8, "hurt")])
def test_batching_gain_compares_the_served_scenario_measured_both_ways(
        compare: dict[str, Any], make_scenario: Callable[..., dict[str, Any]], with_batching: float,
        word: str) -> None:
    compare["scenarios"][1] = make_scenario("served", batching=True, scale=with_batching)
    compare["scenarios"].append(make_scenario("served", batching=False))
    evidence = evidence_of(compare)
    assert evidence.batching_gain == pytest.approx({1: with_batching - 1, 8: with_batching - 1,
                                                    16: with_batching - 1})
    line = next(line for line in evidence.lines if line.startswith("dynamic batching"))
    assert f"at c=8 ({word})" in line
    assert "served (batching)" in evidence.throughput_ratio and "served (no batching)" in evidence.throughput_ratio


def test_batching_not_measured_both_ways_is_named(compare: dict[str, Any]) -> None:
    evidence = evidence_of(compare)
    assert evidence.batching_gain == {}
    assert any("batching off and on" in item for item in evidence.missing)


def test_rules_read_the_row_at_the_expected_concurrency(compare: dict[str, Any]) -> None:
    evidence = evidence_of(compare, concurrency=8)
    assert evidence.direct is not None and evidence.served is not None
    assert (evidence.direct.concurrency, evidence.direct.p99_ms) == (8, 4.0)
    assert (evidence.served.label, evidence.served.p99_ms) == ("served", 4.6)


def test_several_models_read_the_server_measured_beside_other_models(compare: dict[str, Any]) -> None:
    evidence = evidence_of(compare, models=3, concurrency=16)
    assert evidence.served is not None
    assert (evidence.served.label, evidence.served.concurrency, evidence.served.p99_ms) == \
        ("served with 3 models", 16, 8.8)


def test_unmeasured_concurrency_uses_the_next_one_above_and_says_so(compare: dict[str, Any]) -> None:
    evidence = evidence_of(compare, concurrency=4)
    assert evidence.direct is not None and evidence.direct.concurrency == 8
    assert "direct: no row at the expected concurrency 4; the rules use c=8, the nearest measured above it" in \
        evidence.lines


def test_concurrency_beyond_the_sweep_uses_the_largest_and_says_it_is_below(compare: dict[str, Any]) -> None:
    evidence = evidence_of(compare, concurrency=64)
    assert evidence.served is not None and evidence.served.concurrency == 16
    assert any(line.startswith("served: no row at the expected concurrency 64") and line.endswith("below it")
               for line in evidence.lines)


def test_served_point_takes_the_variant_with_the_lower_p99(compare: dict[str, Any],
                                                           make_scenario: Callable[..., dict[str, Any]]) -> None:
    unbatched = make_scenario("served", batching=False)
    for row in unbatched["results"]:
        row["latency_ms"]["p99"] = 3.7
    compare["scenarios"].append(unbatched)
    evidence = evidence_of(compare)
    assert evidence.served is not None
    assert (evidence.served.label, evidence.served.p99_ms) == ("served (no batching)", 3.7)


def test_without_a_served_scenario_only_direct_is_measured(compare: dict[str, Any]) -> None:
    compare["scenarios"] = compare["scenarios"][:1]
    evidence = evidence_of(compare, models=3)
    assert evidence.served is None and evidence.direct is not None
    assert {"scenario served", "scenario served_with_others"} <= set(evidence.missing)


def test_missing_p99_and_unstable_rows_are_reported(compare: dict[str, Any]) -> None:
    del compare["scenarios"][1]["results"][0]["latency_ms"]["p99"]
    compare["scenarios"][1]["results"][2]["stable"] = False
    evidence = evidence_of(compare)
    assert "served[batching] c=1.latency_ms.p99" in evidence.missing
    assert "unstable measurements (outside the stability band): served c=16" in evidence.lines
    assert evidence.served is not None and evidence.served.p99_ms is None


def test_request_rate_rows_and_unknown_scenarios_are_ignored_by_name(
        compare: dict[str, Any], make_row: Callable[..., dict[str, Any]]) -> None:
    rate_row = make_row(1, 100.0, 3.0)
    rate_row.update(concurrency=None, request_rate=100.0)
    compare["scenarios"][0]["results"].append(rate_row)
    compare["scenarios"].append({"name": "edge", "results": []})
    evidence = evidence_of(compare)
    assert "ignored: direct[no batching].results[3]: no concurrency (a request-rate row)" in evidence.lines
    assert "ignored: scenarios[3]: unknown scenario 'edge'" in evidence.lines


def test_infer_throughput_is_used_when_items_are_absent(compare: dict[str, Any]) -> None:
    for item in compare["scenarios"]:
        for row in item["results"]:
            row["throughput_infer_per_s"] = row.pop("throughput_items_per_s") / 2
    assert evidence_of(compare).throughput_ratio["served"][1] == pytest.approx(310 / 320)


def test_a_file_round_trip_keeps_the_model_and_machine(compare: dict[str, Any],
                                                       write_compare: Callable[[object], Path]) -> None:
    path = write_compare(compare)
    evidence = derive(load_compare(path), Inputs())
    assert evidence.lines[0] == f"measured: resnet50 on gpu T4, cpu_count 8 ({path})"


def test_models_together_come_from_the_server_counts_where_recorded(compare: dict[str, Any]) -> None:
    _record_server_counts(compare)
    lines = evidence_of(compare).lines
    assert ("served with 3 models, all models together vs one model alone: 812/s = 2.62x at c=1, "
            "6,160/s = 2.37x at c=8, 7,560/s = 2.36x at c=16") in lines


def _record_server_counts(compare: dict[str, Any], windows: bool = True) -> None:
    served, others = compare["scenarios"][1], compare["scenarios"][2]
    for row in served["results"]:
        row["server_models_per_s"] = {"resnet50": row["throughput_infer_per_s"]}
    for row in others["results"]:  # the measured model plus two peers at 90% of its rate
        rate = row["throughput_infer_per_s"]
        row["server_models_per_s"] = {"resnet50": rate, "resnet50_peer1": rate * 0.9, "resnet50_peer2": rate * 0.9}
    for row in served["results"] + others["results"]:
        if windows:
            row["window_span_ns"] = [10**9, 4 * 10**9]


def test_server_counts_from_before_they_matched_the_kept_windows_are_not_used(compare: dict[str, Any]) -> None:
    _record_server_counts(compare, windows=False)
    lines = evidence_of(compare).lines
    assert not any("all models together" in line for line in lines)
    assert any(line.startswith("ignored: ") and "server_models_per_s: counted over the whole level" in line
               for line in lines)


def test_results_without_server_counts_say_nothing_about_models_together(compare: dict[str, Any]) -> None:
    assert not any("all models together" in line for line in evidence_of(compare).lines)


def test_server_counts_that_are_not_numbers_are_refused(compare: dict[str, Any]) -> None:
    from kiln.errors import InvalidArgumentError

    compare["scenarios"][2]["results"][0]["server_models_per_s"] = {"resnet50": "fast"}
    compare["scenarios"][2]["results"][0]["window_span_ns"] = [10**9, 4 * 10**9]
    with pytest.raises(InvalidArgumentError, match="server_models_per_s.resnet50"):
        evidence_of(compare)


@pytest.mark.parametrize(("cpu", "says"), [
    ({"process": 1.0, "busiest_thread": 0.97, "children": 2.1, "busiest_child": 0.6, "machine_idle_pct": 70.0,
      "main_thread": 0.97}, "the server process's event loop was busy 0.97 of a core"),
    ({"process": 1.0, "busiest_thread": 0.97, "children": 2.1, "busiest_child": 0.6, "machine_idle_pct": 70.0},
     "one thread of the server process (its event loop, or on a GPU host the thread that waits for the device) was "
     "busy 0.97 of a core"),  # a file written before the main thread was measured
    ({"process": 1.3, "busiest_thread": 0.93, "children": 1.8, "busiest_child": 0.5, "machine_idle_pct": 67.0,
      "main_thread": 0.4}, "no thread, worker or core was saturated"),  # the busy thread waits for the GPU
    ({"process": 0.5, "busiest_thread": 0.45, "children": 1.2, "busiest_child": 0.93, "machine_idle_pct": 80.0},
     "one frontend worker process was busy 0.93 of a core"),
    ({"process": 0.7, "busiest_thread": 0.6, "children": 5.0, "busiest_child": 0.7, "machine_idle_pct": 4.0},
     "the machine's cores were busy (4% idle)"),
    ({"process": 0.3, "busiest_thread": 0.2, "children": 0.5, "busiest_child": 0.2, "machine_idle_pct": 85.0},
     "no thread, worker or core was saturated"),
])
def test_the_served_points_cpu_names_what_limited_it(compare: dict[str, Any], cpu: dict[str, float],
                                                      says: str) -> None:
    compare["scenarios"][1]["results"][1]["cpu"] = cpu  # served, c=8
    lines = [line for line in evidence_of(compare, concurrency=8).lines if line.startswith("what limited")]
    assert len(lines) == 1 and lines[0].startswith("what limited served at c=8: " + says), lines


def test_the_limit_line_gives_the_servers_batches_where_compare_counted_them(compare: dict[str, Any]) -> None:
    level = compare["scenarios"][1]["results"][1]  # served, c=8
    level["cpu"] = {"process": 1.0, "busiest_thread": 0.9, "children": 1.0, "busiest_child": 0.4,
                    "machine_idle_pct": 70.0, "main_thread": 0.9}
    level["server_rows_per_execution"] = {compare["model"]: 1.43, "peer": 9.0}
    lines = [line for line in evidence_of(compare, concurrency=8).lines if line.startswith("what limited")]
    assert lines and lines[0].endswith("; the server ran batches of 1.4 rows there"), lines
    level["server_rows_per_execution"] = {"peer": 9.0}  # the measured model ran no batch in those windows
    lines = [line for line in evidence_of(compare, concurrency=8).lines if line.startswith("what limited")]
    assert lines and "batches of" not in lines[0], lines


def test_results_without_cpu_figures_say_nothing_about_the_limit(compare: dict[str, Any]) -> None:
    compare["scenarios"][1]["results"][2]["cpu"] = {"process": 1.0, "busiest_thread": 0.97, "children": 0.0,
                                                    "machine_idle_pct": 70.0}  # c=16, not the point read
    evidence = evidence_of(compare, concurrency=8)
    assert not any(line.startswith("what limited") for line in evidence.lines)
    assert parse_compare(compare, Path("compare.json")).named("served")[0].rows[2].cpu is not None
