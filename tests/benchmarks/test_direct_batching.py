"""Smoke test of benchmarks/direct_batching.py: threads on a kiln.load'd mlp, batching on and off."""

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
        assert row["calls_per_s"] > 0 and row["average_batch"] >= 1, row
    assert rows[0]["average_batch"] == 1  # a lone caller runs alone
    assert (output.with_suffix(".txt")).read_text().count("|") > 10
