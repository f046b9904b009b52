"""``kiln bench compare`` end to end: run the comparison, keep a partial report after each scenario, write the
report and print its tables."""

from __future__ import annotations

import shlex
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from kiln._flags import command_words
from kiln.bench.compare import CompareOptions, Comparison
from kiln.bench.report import comparison_table, markdown_table, memory_table, write_report


def command_line(options: CompareOptions) -> list[str]:
    """The command that repeats this comparison, every setting spelled out."""
    return ["kiln", "bench", "compare", *command_words(options)]


def run_and_report(options: CompareOptions, output: Path | None = None, *, quiet: bool = False) -> dict[str, Path]:
    """Run the comparison and write its report into ``output`` (default ./kiln-compare-MODEL), a partial one after
    each scenario; print the tables and where the report is. Returns the files written."""
    output = output if output is not None else Path(f"kiln-compare-{options.model}")
    command = command_line(options)

    def note(text: str) -> None:
        if not quiet:
            print(f"kiln bench compare: {text}", file=sys.stderr, flush=True)

    def partial(doc: dict[str, Any]) -> None:
        write_report(doc, output, command)
        note(f"partial report written to {output} ({len(doc['scenarios'])} scenario(s) so far)")

    with _sigterm_unwinds():
        doc = Comparison(options, note).run(on_progress=partial)
    written = write_report(doc, output, command)
    print(markdown_table(comparison_table(doc)))
    print(markdown_table(memory_table(doc)))
    print(f"report: {shlex.quote(str(written['report.html']))} (with compare.json, compare.md and the plots)")
    return written


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises SystemExit, so the servers and load processes are stopped as on Ctrl-C."""
    def handle(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
