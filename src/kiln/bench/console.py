"""A bench run on a terminal, as ``kiln bench`` shows it: each level as it is measured, then the summary; the
result written as JSON and CSV where asked."""

from __future__ import annotations

import sys
from pathlib import Path

from kiln.bench.options import BenchOptions
from kiln.bench.progress import Progress
from kiln.bench.result import BenchResult, LevelResult
from kiln.bench.runner import run
from kiln.bench.table import header, level_block, summary


def run_and_print(options: BenchOptions, *, json_path: Path | None = None, csv_path: Path | None = None,
                  quiet: bool = False) -> BenchResult:
    """Measure, printing to stdout (progress on stderr unless ``quiet``); warns when a level did not stabilize."""
    progress = Progress(enabled=not quiet, stability_percentage=options.stability_percentage,
                        max_trials=options.max_trials)

    def show(level: LevelResult) -> None:
        print(level_block(level), flush=True)

    print(header(options), flush=True)
    result = run(options, progress, on_level=show)
    print(summary(result), end="")
    if json_path is not None:
        result.write_json(json_path)
    if csv_path is not None:
        result.write_csv(csv_path)
    unstable = [level for level in result.results if not level.stable]
    if unstable:
        print(f"kiln bench: {len(unstable)} level(s) did not stabilize within {options.max_trials} windows; "
              f"raise --max-trials or --measurement-interval", file=sys.stderr)
    return result
