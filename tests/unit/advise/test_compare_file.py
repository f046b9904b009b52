"""Files that are not `kiln bench compare` results fail with a message naming the file and the problem."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kiln.advise.compare_file import load_compare
from kiln.errors import InvalidArgumentError


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"--evidence .*nope\.json: cannot read the file"):
        load_compare(tmp_path / "nope.json")


def test_a_file_that_is_not_json_says_where_it_breaks(tmp_path: Path) -> None:
    path = tmp_path / "compare.json"
    path.write_text('{"model": "m",\n  scenarios: []}')
    with pytest.raises(InvalidArgumentError, match=r"not JSON \(line 2, column 3.*expected a JSON object written by"):
        load_compare(path)


@pytest.mark.parametrize(("data", "problem"), [
    ([1, 2], "the file is list, not an object"),
    ({"model": "m", "target": "http", "results": []}, "the file has no 'scenarios'"),
    ({"scenarios": {"direct": []}}, "scenarios is dict, not a list"),
    ({"scenarios": []}, "scenarios holds none of direct, served, served_with_others"),
    ({"scenarios": [{"name": "edge", "results": []}]}, "scenarios holds none of"),
    ({"scenarios": ["direct"]}, r"scenarios\[0\] is str, not an object"),
    ({"scenarios": [{"results": []}]}, r"scenarios\[0\].name is None, not one of"),
    ({"scenarios": [{"name": "direct"}]}, r"scenarios\[0\] has no 'results'"),
    ({"scenarios": [{"name": "direct", "results": {}}]}, r"scenarios\[0\].results is dict, not a list"),
    ({"scenarios": [{"name": "direct", "batching": "yes", "results": []}]},
     r"scenarios\[0\].batching is 'yes', not true or false"),
    ({"scenarios": [{"name": "direct", "models_loaded": 1.5, "results": []}]},
     r"scenarios\[0\].models_loaded is 1.5, not a whole number"),
    ({"scenarios": [{"name": "direct", "results": [{"concurrency": "1"}]}]},
     r"direct.results\[0\].concurrency is '1', not a whole number"),
    ({"scenarios": [{"name": "direct", "results": [{"concurrency": 1, "throughput_items_per_s": "fast"}]}]},
     r"direct c=1.throughput_items_per_s is 'fast', not a number"),
    ({"scenarios": [{"name": "direct", "results": [{"concurrency": 1, "latency_ms": {"p99": True}}]}]},
     r"direct c=1.latency_ms.p99 is True, not a number"),
    ({"scenarios": [{"name": "direct", "results": [{"concurrency": 1, "latency_ms": [3.0]}]}]},
     r"direct c=1.latency_ms is list, not an object"),
    ({"scenarios": [{"name": "direct", "results": []}], "memory_mb": {"direct": {"peak": "2 GB"}}},
     r"memory_mb.direct.peak is '2 GB', not a number"),
])
def test_malformed_results_fail_clearly(write_compare: Callable[[object], Path], data: Any, problem: str) -> None:
    path = write_compare(data)
    with pytest.raises(InvalidArgumentError, match=rf"--evidence {path}: {problem}"):
        load_compare(path)


def test_a_plain_bench_result_is_refused(write_compare: Callable[[object], Path],
                                         make_row: Callable[..., dict[str, Any]]) -> None:
    path = write_compare({"model": "simple", "target": "http", "url": "localhost:8000", "batch_size": 1,
                          "machine": {}, "results": [make_row(1, 100.0, 2.0)]})
    with pytest.raises(InvalidArgumentError, match="has no 'scenarios'; expected a JSON object written by"):
        load_compare(path)


def test_a_minimal_result_loads_and_lists_what_it_lacks(write_compare: Callable[[object], Path]) -> None:
    result = load_compare(write_compare({"scenarios": [{"name": "direct", "results": [{"concurrency": 1}]}]}))
    assert [s.name for s in result.scenarios] == ["direct"]
    assert result.missing == ("direct c=1.throughput_infer_per_s", "direct c=1.latency_ms", "scenario served",
                              "scenario served_with_others", "memory_mb.direct", "model")
    assert result.memory == {}


def test_duplicate_scenarios_and_rows_keep_the_first(write_compare: Callable[[object], Path],
                                                     make_row: Callable[..., dict[str, Any]]) -> None:
    rows = [make_row(8, 100.0, 2.0), make_row(1, 50.0, 1.0), make_row(8, 999.0, 9.0)]
    result = load_compare(write_compare({"scenarios": [
        {"name": "direct", "batching": False, "results": rows},
        {"name": "direct", "batching": False, "results": []}]}))
    direct, = result.scenarios
    assert [(r.concurrency, r.throughput_per_s) for r in direct.rows] == [(1, 50.0), (8, 100.0)]
    assert result.ignored == ("direct[no batching].results[2]: a second row for concurrency 8",
                              "scenarios[1]: a second 'direct' scenario with batching=False")
