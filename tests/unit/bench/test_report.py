"""The compare report from a synthetic compare result: the table's layout and ratios, the plots, the HTML page."""

from __future__ import annotations

import base64
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from kiln.bench.report import (
    BATCH_TITLE,
    CPU_TITLE,
    PLOTS,
    TOGETHER_TITLE,
    batch_table,
    comparison_table,
    cpu_table,
    markdown,
    memory_table,
    scenario_label,
    together_table,
    write_report,
)
from kiln.bench.report_html import render_html
from kiln.bench.resources import CpuFigures, MemoryFigures
from kiln.bench.result import Latency, LevelResult

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def row(concurrency: int, throughput: float, p99: float, rss_peak: float = 120.0) -> dict[str, Any]:
    level = LevelResult(concurrency=concurrency, request_rate=None, throughput_infer_per_s=throughput,
                        throughput_items_per_s=throughput, latency_ms=Latency(p99 / 3, p99 / 2, p99 / 1.5, p99 / 1.2,
                                                                               p99),
                        client_ms=None, server_us=None, stable=True, windows=3, errors=0,
                        memory_mb=MemoryFigures(rss_idle=100.0, rss_peak=rss_peak), requests=100, duration_s=1.0)
    return dataclasses.asdict(level)


def scenario(name: str, batching: bool, models: int, figures: list[tuple[int, float, float]],
             idle: float, peak: float) -> dict[str, Any]:
    return {"name": name, "batching": batching, "models_loaded": models,
            "results": [row(c, t, p) for c, t, p in figures], "memory_mb": {"idle": idle, "peak": peak}}


@pytest.fixture
def doc() -> dict[str, Any]:
    """Shaped like the seed article's T4 table (ratios, not absolute truth)."""
    return {
        "model": "resnet50", "concurrency": [1, 8, 16], "protocol": "http",
        "machine": {"cpu_model": "Test CPU", "cpu_count": 2, "memory_total": "8 GB", "os": "Linux", "python": "3.11",
                    "kiln": "0.1.0", "gpus": ["NVIDIA T4"]},
        "scenarios": [
            scenario("direct", False, 1, [(1, 320, 3.5), (8, 2800, 4.0), (16, 3500, 6.0)], 1200.0, 2800.0),
            scenario("served", False, 1, [(1, 310, 3.8), (8, 2600, 4.4), (16, 3200, 7.0)], 2000.0, 3000.0),
            scenario("served", True, 1, [(1, 300, 4.0), (8, 3400, 3.9), (16, 4500, 5.5)], 2000.0, 3300.0),
            scenario("served_with_others", False, 3, [(1, 290, 4.2), (8, 2200, 5.0), (16, 2700, 9.0)], 2500.0,
                     4100.0),
        ],
        "memory_mb": {"direct": {"idle": 1200.0, "peak": 2800.0},
                      "served": {"idle": 2000.0, "peak": 3300.0, "batching": True},
                      "served_with_others": {"idle": 2500.0, "peak": 4100.0, "batching": False, "models": 3}},
        "notes": ["a note <with> markup"],
    }


def test_table_has_a_row_per_scenario_and_ratios_to_direct(doc: dict[str, Any]) -> None:
    table = comparison_table(doc)
    assert table.header == ["scenario", "c=1 req/s (vs direct)", "c=8 req/s (vs direct)", "c=16 req/s (vs direct)",
                            "c=1 p99 ms", "c=8 p99 ms", "c=16 p99 ms", "RSS idle MiB", "RSS peak MiB"]
    assert [r[0] for r in table.rows] == ["direct", "served, 1 model", "served, 1 model, dynamic batching",
                                          "served, 3 models"]
    assert table.rows[0][1:4] == ["320 (1.00x)", "2,800 (1.00x)", "3,500 (1.00x)"]
    assert table.rows[1][1:4] == ["310 (0.97x)", "2,600 (0.93x)", "3,200 (0.91x)"]
    assert table.rows[2][3] == "4,500 (1.29x)"  # batching above direct shows as a ratio above 1
    assert table.rows[3][1:] == ["290 (0.91x)", "2,200 (0.79x)", "2,700 (0.77x)", "4.20", "5.00", "9.00",
                                 "2,500.0", "4,100.0"]


def _with_server_counts(doc: dict[str, Any]) -> dict[str, Any]:
    """Per-model server rates on the served levels: one model alone, or three with the peers' shares."""
    for entry in doc["scenarios"][1:]:
        for level in entry["results"]:
            rate = level["throughput_infer_per_s"]
            peers = {f"resnet50_peer{i}": rate * 0.9 for i in range(1, entry["models_loaded"])}
            level["server_models_per_s"] = {"resnet50": rate, **peers}
    return doc


def test_batch_table_shows_the_measured_models_batches_per_served_level(doc: dict[str, Any]) -> None:
    assert batch_table(doc) is None  # files written before batches were counted
    assert BATCH_TITLE not in markdown(doc)
    served = doc["scenarios"][2]
    served["results"][1]["server_rows_per_execution"] = {"resnet50": 3.24, "resnet50_peer1": 9.0}
    served["results"][2]["server_rows_per_execution"] = {"resnet50_peer1": 2.0}  # the measured model ran nothing
    table = batch_table(doc)
    assert table is not None
    assert table.header == ["scenario", "c=1", "c=8", "c=16"]
    assert table.rows == [[scenario_label(served), "-", "3.2", "-"]]
    assert f"## {BATCH_TITLE}" in markdown(doc) and "<h2>Batches (rows per execution" in render_html(doc, {})


def test_together_table_sums_every_model_and_compares_with_one_model(doc: dict[str, Any]) -> None:
    table = together_table(_with_server_counts(doc))
    assert table is not None
    assert table.header == ["scenario", "c=1 req/s (vs 1 model)", "c=8 req/s (vs 1 model)", "c=16 req/s (vs 1 model)"]
    assert [r[0] for r in table.rows] == ["served, 1 model", "served, 1 model, dynamic batching", "served, 3 models"]
    assert table.rows[0][1:] == ["310 (1.00x)", "2,600 (1.00x)", "3,200 (1.00x)"]
    # 3 models without batching: 290 + 2 x 261 = 812 against 310 alone (the no-batching one-model row)
    assert table.rows[2][1:] == ["812 (2.62x)", "6,160 (2.37x)", "7,560 (2.36x)"]
    assert TOGETHER_TITLE in markdown(doc) and TOGETHER_TITLE in render_html(doc, {})


def test_a_comparison_without_server_counts_has_no_together_table(doc: dict[str, Any]) -> None:
    assert together_table(doc) is None
    assert TOGETHER_TITLE not in markdown(doc) and TOGETHER_TITLE not in render_html(doc, {})


def test_missing_level_or_direct_row_shows_a_dash_and_no_ratio(doc: dict[str, Any]) -> None:
    doc["scenarios"][1]["results"] = doc["scenarios"][1]["results"][:1]  # c=8, c=16 missing
    table = comparison_table(doc)
    assert table.rows[1][1:7] == ["310 (0.97x)", "-", "-", "3.80", "-", "-"]
    doc["scenarios"] = doc["scenarios"][1:]
    assert comparison_table(doc).rows[0][1] == "310"


def test_markdown_lays_out_both_tables_like_the_seed_article(doc: dict[str, Any]) -> None:
    text = markdown(doc, "kiln bench compare resnet50")
    lines = text.splitlines()
    header = lines.index("| scenario | c=1 req/s (vs direct) | c=8 req/s (vs direct) | c=16 req/s (vs direct) | "
                         "c=1 p99 ms | c=8 p99 ms | c=16 p99 ms | RSS idle MiB | RSS peak MiB |")
    assert lines[header + 1] == "| --- " + "| ---: " * 8 + "|"
    assert lines[header + 2].startswith("| direct | 320 (1.00x) |")
    assert lines[header + 5].startswith("| served, 3 models | 290 (0.91x) |")
    assert "| deployment | RSS idle MiB | RSS peak MiB |" in lines
    assert "| server, 3 models, no batching | 2,500.0 | 4,100.0 |" in lines
    assert "| server, one model, dynamic batching | 2,000.0 | 3,300.0 |" in lines
    assert "Command: `kiln bench compare resnet50`" in lines
    assert "- a note <with> markup" in lines
    assert "Test CPU, 2 cores, 8 GB, NVIDIA T4" in text


def test_the_server_flags_of_serve_args_are_named_in_both_reports(doc: dict[str, Any]) -> None:
    assert "ran with" not in markdown(doc) and "ran with" not in render_html(doc, {})
    doc["settings"] = {"serve_args": ["--http-workers", "8", "--log-format", "<iso> 8601"]}
    assert ("Served scenarios are measured over http; peers receive the same concurrency as the model. `kiln serve` "
            "ran with `--http-workers 8 --log-format '<iso> 8601'`.") in markdown(doc).splitlines()
    assert ("<code>kiln serve</code> ran with <code>--http-workers 8 --log-format &#x27;&lt;iso&gt; 8601&#x27;</code>."
            "</p>") in render_html(doc, {})


def test_memory_table_names_each_deployment(doc: dict[str, Any]) -> None:
    assert [r[0] for r in memory_table(doc).rows] == ["direct process", "server, one model, dynamic batching",
                                                      "server, 3 models, no batching"]
    assert scenario_label(doc["scenarios"][2]) == "served, 1 model, dynamic batching"


def test_rows_perf_analyzer_made_are_labelled_so(doc: dict[str, Any]) -> None:
    scenario = doc["scenarios"][2]
    assert scenario["results"]
    measured = {**scenario, "results": [{**row, "load_generator": "perf_analyzer"} for row in scenario["results"]]}
    assert scenario_label(measured) == "served, 1 model, dynamic batching (perf_analyzer)"
    assert scenario_label({**scenario, "results": [{**row, "load_generator": "kiln"} for row in scenario["results"]]}
                          ) == "served, 1 model, dynamic batching"


def test_write_report_writes_every_file_and_non_empty_plots(doc: dict[str, Any], tmp_path: Path) -> None:
    image = pytest.importorskip("matplotlib.image", reason="matplotlib (the bench extra) draws the plots")
    written = write_report(doc, tmp_path / "out", ["kiln", "bench", "compare", "resnet50"])
    assert set(written) == {"compare.json", "compare.md", "report.html", *PLOTS}
    for name in PLOTS:
        data = written[name].read_bytes()
        assert data.startswith(PNG_MAGIC)
        pixels = image.imread(written[name])
        assert pixels.shape[:2] == (450, 800)  # 8 x 4.5 inches at 100 dpi
        assert (pixels[..., :3] < 0.9).any(axis=-1).mean() > 0.01  # something drawn, not a blank canvas
    assert '"model": "resnet50"' in written["compare.json"].read_text()


def test_html_is_self_contained(doc: dict[str, Any], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib (the bench extra) draws the plots")
    written = write_report(doc, tmp_path, ["kiln", "bench", "compare", "resnet50"])
    page = written["report.html"].read_text()
    without_images = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", page)
    assert not re.search(r"(?:https?:)?//|url\(", without_images)  # nothing fetched from anywhere
    assert "<script" not in page and "<link" not in page
    sources = re.findall(r'src="([^"]*)"', page)
    assert len(sources) == len(PLOTS)
    for source, name in zip(sources, PLOTS, strict=True):
        prefix = "data:image/png;base64,"
        assert source.startswith(prefix)
        assert base64.b64decode(source[len(prefix):]) == written[name].read_bytes()
    assert "<td>served, 3 models</td>" in page and '<td class="num">290 (0.91x)</td>' in page
    assert "a note &lt;with&gt; markup" in page  # escaped


def test_html_renders_without_plots_or_command(doc: dict[str, Any]) -> None:
    page = render_html(doc, {})
    assert "<img" not in page and "Command" not in page
    assert "<h1>kiln bench compare: resnet50</h1>" in page


def test_gpu_memory_columns_appear_only_when_measured(doc: dict[str, Any], tmp_path: Path) -> None:
    assert memory_table(doc).header == ["deployment", "RSS idle MiB", "RSS peak MiB"]
    doc["memory_mb"]["direct"].update(gpu_idle=1229.0, gpu_peak=2867.0)
    doc["memory_mb"]["served"].update(gpu_idle=None, gpu_peak=None)
    table = memory_table(doc)
    assert table.header == ["deployment", "RSS idle MiB", "RSS peak MiB", "GPU idle MiB", "GPU peak MiB"]
    assert table.rows[0][3:] == ["1,229.0", "2,867.0"] and table.rows[1][3:] == ["-", "-"]
    pytest.importorskip("matplotlib", reason="matplotlib (the bench extra) draws the memory plot")
    assert write_report(doc, tmp_path, None)["memory.png"].read_bytes().startswith(PNG_MAGIC)


def test_a_level_that_counted_no_request_is_a_dash_and_slow_rates_keep_a_decimal(doc: dict[str, Any]) -> None:
    direct = doc["scenarios"][0]
    direct["results"][0].update(throughput_infer_per_s=6.2)
    direct["results"][1].update(requests=0, throughput_infer_per_s=0.0)
    table = comparison_table(doc)
    assert table.rows[0][1] == "6.2 (1.00x)"
    assert table.rows[0][2] == "-" and table.rows[0][5] == "-"
    assert table.rows[1][2] == "2,600", "no ratio against a level the direct row did not measure"


def test_cpu_table_shows_where_each_level_spent_its_cpu(doc: dict[str, Any]) -> None:
    assert cpu_table(doc) is None  # files written before CPU was measured
    assert CPU_TITLE not in markdown(doc) and CPU_TITLE not in render_html(doc, {})
    served = doc["scenarios"][2]
    served["results"][2]["cpu"] = dataclasses.asdict(CpuFigures(process=1.02, busiest_thread=0.941, children=2.5,
                                                                machine_idle_pct=68.4, busiest_child=0.98))
    table = cpu_table(doc)
    assert table is not None
    assert table.header == ["scenario", "c=1", "c=8", "c=16"]
    assert table.rows == [["served, 1 model, dynamic batching", "-", "-", "1.02 / - / 0.94 / 2.50 (0.98), 68% idle"]]
    text = markdown(doc)
    assert f"## {CPU_TITLE}" in text
    assert "| served, 1 model, dynamic batching | - | - | 1.02 / - / 0.94 / 2.50 (0.98), 68% idle |" in text
    assert "1.02 / - / 0.94 / 2.50 (0.98), 68% idle" in render_html(doc, {})
    assert LevelResult.from_dict(served["results"][2]).cpu == CpuFigures(1.02, 0.941, 2.5, 68.4, 0.98)
    assert LevelResult.from_dict(served["results"][1]).cpu is None
    served["results"][2]["cpu"]["main_thread"] = 0.52
    table = cpu_table(doc)
    assert table is not None and table.rows[0][3] == "1.02 / 0.52 / 0.94 / 2.50 (0.98), 68% idle"
