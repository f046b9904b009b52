"""The JSON contract other tools read, the CSV layout, and the text table."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from pathlib import Path

import pytest

from kiln.bench.measure import Measurement
from kiln.bench.records import Level
from kiln.bench.resources import CpuFigures, MemoryFigures
from kiln.bench.result import CSV_COLUMNS, BenchResult, LevelResult
from kiln.bench.schedule import SendCounts
from kiln.bench.server_stats import Duration, ServerCounters
from kiln.bench.stats import summarize
from kiln.bench.table import level_block, summary

MS = 1_000_000
RESULT_KEYS = {"concurrency", "request_rate", "throughput_infer_per_s", "throughput_items_per_s", "latency_ms",
               "client_ms", "server_us", "stable", "windows", "errors", "memory_mb"}


def measurement(level: Level, client: bool, server: bool, sends: SendCounts | None = None) -> Measurement:
    counters = ServerCounters(200, {"queue": Duration(200, 200 * 50_000), "compute_input": Duration(200, 200_000),
                                    "compute_infer": Duration(200, 200 * 400_000),
                                    "compute_output": Duration(200, 200 * 20_000)})
    return Measurement(level=level, windows=4, stable=True, requests=200, duration_ns=2_000 * MS,
                       latency=summarize([MS] * 180 + [3 * MS] * 20), errors=1,
                       client_send_ns=100_000.0 if client else None, client_recv_ns=50_000.0 if client else None,
                       server=counters if server else None, sends=sends,
                       memory=MemoryFigures(rss_idle=100.0, rss_peak=120.5, gpu_idle=None, gpu_peak=None))


def bench_result() -> BenchResult:
    results = [LevelResult.from_measurement(measurement(Level(concurrency=2), True, True), batch_size=4),
               LevelResult.from_measurement(measurement(Level(request_rate=50.0), False, False,
                                                        SendCounts(100, 3, 1)), batch_size=4)]
    return BenchResult(model="simple", target="http", url="127.0.0.1:8000", batch_size=4,
                       machine={"cpu_count": 2}, results=results, options={"measurement_interval_ms": 500})


def test_json_has_the_agreed_keys_and_units() -> None:
    doc = json.loads(bench_result().to_json())
    assert {"model", "target", "url", "batch_size", "machine", "results"} <= set(doc)
    first, second = doc["results"]
    assert RESULT_KEYS <= set(first)
    assert first["concurrency"] == 2 and first["request_rate"] is None
    assert first["throughput_infer_per_s"] == pytest.approx(100.0)  # 200 requests in 2 s
    assert first["throughput_items_per_s"] == pytest.approx(400.0)  # x batch size 4
    assert first["latency_ms"] == pytest.approx({"avg": 1.2, "p50": 1.0, "p90": 1.0, "p95": 3.0, "p99": 3.0})
    assert first["client_ms"] == pytest.approx({"send": 0.1, "recv": 0.05})
    assert first["server_us"] == pytest.approx({"queue": 50.0, "compute_input": 1.0, "compute_infer": 400.0,
                                                "compute_output": 20.0})
    assert first["memory_mb"] == {"rss_idle": 100.0, "rss_peak": 120.5, "gpu_idle": None, "gpu_peak": None}
    assert (first["stable"], first["windows"], first["errors"]) == (True, 4, 1)
    assert second["concurrency"] is None and second["request_rate"] == 50.0
    assert second["client_ms"] is None and second["server_us"] is None
    assert second["sends"] == {"scheduled": 100, "delayed": 3, "dropped": 1}


def test_json_round_trips(tmp_path: Path) -> None:
    result = bench_result()
    path = tmp_path / "bench.json"
    result.write_json(path)
    assert BenchResult.from_json(path.read_text()) == result


def test_csv_starts_with_perf_analyzers_columns_in_microseconds(tmp_path: Path) -> None:
    path = tmp_path / "bench.csv"
    bench_result().write_csv(path)
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert list(CSV_COLUMNS[:4]) == ["Concurrency", "Inferences/Second", "Client Send", "Network+Server Send/Recv"]
    first, second = rows
    assert first["Concurrency"] == "2" and first["Inferences/Second"] == "400.0"  # perf_analyzer counts items
    assert first["Requests/Second"] == "100.0"
    assert (first["Client Send"], first["Client Recv"], first["p50 latency"], first["p99 latency"]) == \
        ("100", "50", "1000", "3000")
    assert (first["Server Queue"], first["Server Compute Infer"]) == ("50", "400")
    # 1200 us average - 150 us client - 471 us server phases
    assert first["Network+Server Send/Recv"] == "579"
    assert first["RSS Peak MiB"] == "120.5" and first["GPU Peak MiB"] == ""
    assert second["Concurrency"] == "" and second["Request Rate"] == "50.0"
    assert second["Client Send"] == "" and second["Server Queue"] == ""
    assert (second["Sends Delayed"], second["Sends Dropped"]) == ("3", "1")


def test_text_output_shows_each_figure() -> None:
    result = bench_result()
    block = level_block(result.results[0])
    assert "Request concurrency: 2" in block
    assert "Throughput: 100.0 infer/sec (400.0 items/sec)" in block
    assert "p99 latency: 3000 usec" in block
    assert "send 100 usec + response wait 1050 usec + recv 50 usec" in block
    assert "queue 50 + compute input 1 + compute infer 400 + compute output 20" in block
    assert "RSS idle 100.0 MiB, peak 120.5 MiB; GPU idle -, peak -" in block
    assert "Sends: 100 scheduled, 3 delayed, 1 dropped" in level_block(result.results[1])
    lines = summary(result).splitlines()
    assert lines[1].split() == ["load", "infer/s", "items/s", "avg", "ms", "p50", "ms", "p90", "ms", "p95", "ms",
                                "p99", "ms", "errors", "stable"]
    assert lines[3].split()[:3] == ["c=2", "100.0", "400.0"]
    assert lines[4].split()[0] == "50/s"


def test_cpu_figures_travel_through_json_and_text(tmp_path: Path) -> None:
    result = bench_result()
    cpu = CpuFigures(process=1.02, busiest_thread=0.94, children=2.5, machine_idle_pct=68.4, busiest_child=1.5,
                     main_thread=0.61)
    result = dataclasses.replace(result, results=[dataclasses.replace(result.results[0], cpu=cpu),
                                                  result.results[1]])
    path = tmp_path / "bench.json"
    result.write_json(path)
    assert BenchResult.from_json(path.read_text()) == result
    assert ("CPU (cores): process 1.02, its main thread 0.61, its busiest thread 0.94, its children 2.50 (busiest "
            "1.50); machine 68% idle" in level_block(result.results[0]))
    assert "CPU (cores)" not in level_block(result.results[1])  # not measured (no psutil)
