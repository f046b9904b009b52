"""benchmarks/fuzz.py for a few seconds with one worker: it fuzzes every kind of surface, the checker holds, and the
results and the corpus are written (findings are the script's to report, not this test's)."""

from __future__ import annotations

import json
from pathlib import Path

from ._smoke import read_json, run_main


def test_fuzz_smoke(tmp_path: Path) -> None:
    output = tmp_path / "fuzz-smoke.json"
    rc = run_main("fuzz", "--minutes", "0.15", "--processes", "1", "--output", str(output))
    data = read_json(output)
    assert rc == (1 if data["unknown_findings"] else 0)
    assert data["inputs_total"] > 200 and data["inputs_per_s"] > 0
    wheres = {key.split("@")[1] for key in data["per_surface"]}
    assert wheres == {"app", "wire", "grpc", "config"}
    assert data["checker_failures"] == 0 and data["fuzzer_errors"] == {}
    corpus = list((tmp_path / "fuzz-corpus").glob("*.jsonl"))
    assert corpus and all(json.loads(line)["case"] for f in corpus for line in f.read_text().splitlines())
