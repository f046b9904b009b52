"""Smoke test of benchmarks/direct_batching.py: threads and coroutines on a kiln.load'd mlp, batching on and off."""

from __future__ import annotations

from pathlib import Path

from ._smoke import read_json, run_main


def test_direct_batching(tmp_path: Path) -> None:
    output = tmp_path / "direct.json"
    assert run_main("direct_batching", "--model", "mlp", "--threads", "1,4", "--seconds", "0.3", "--warmup", "0.1",
                    "--output", str(output)) == 0
    rows = read_json(output)["rows"]
    assert [(row["threads"], row["batching"]) for row in rows] == [(1, True), (1, False), (4, True), (4, False)]
    for row in rows:
        assert row["calls"] == "threads" and row["calls_per_s"] > 0 and row["average_batch"] >= 1, row
        assert len(row["busiest_threads"]) <= 3 and row["process_cores"] > 0, row
        assert "callers" in row["thread_cores"], row  # the calling threads, counted together under one name
    assert rows[0]["average_batch"] == 1  # a lone caller runs alone
    assert (output.with_suffix(".txt")).read_text().count("|") > 10


def test_direct_batching_from_coroutines(tmp_path: Path) -> None:
    output = tmp_path / "direct.json"
    assert run_main("direct_batching", "--model", "mlp", "--threads", "4", "--calls", "asyncio", "--batching", "on",
                    "--seconds", "0.3", "--warmup", "0.1", "--output", str(output)) == 0
    (row,) = read_json(output)["rows"]
    assert row["calls"] == "asyncio" and row["batching"] and row["calls_per_s"] > 0
    assert row["average_batch"] > 1  # four coroutines awaiting at once share batches
    assert "MainThread" in [name for name, _cores in row["busiest_threads"]]  # the event loop's thread
