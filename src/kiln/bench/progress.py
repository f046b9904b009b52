"""The progress line on stderr: one update per measurement window, in place on a terminal."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

from kiln.bench.measure import Window, is_stable
from kiln.bench.records import Level


class Progress:
    def __init__(self, enabled: bool = True, stream: TextIO | None = None, stability_percentage: float = 10.0,
                 max_trials: int = 10) -> None:
        self.enabled = enabled
        self._stream = stream if stream is not None else sys.stderr
        self._live = enabled and self._stream.isatty()
        self._stability = stability_percentage
        self._max_trials = max_trials
        self._width = 0

    def note(self, message: str) -> None:
        self._clear()
        self._write(f"kiln bench: {message}\n")

    def window(self, level: Level, windows: Sequence[Window]) -> None:
        last = windows[-1]
        text = (f"kiln bench: {level.describe()}: window {len(windows)}/{self._max_trials}: "
                f"{last.throughput_per_s:.1f} infer/s, avg {last.avg_latency_ns / 1e6:.3f} ms")
        if last.errors:
            text += f", {last.errors} errors"
        if is_stable(windows, self._stability):
            text += ", stable"
        if self._live:
            self._write("\r" + text.ljust(self._width))
            self._width = len(text)
        else:
            self._write(text + "\n")

    def end_level(self) -> None:
        self._clear()

    def _clear(self) -> None:
        if self._live and self._width:
            self._write("\n")
            self._width = 0

    def _write(self, text: str) -> None:
        if self.enabled:
            self._stream.write(text)
            self._stream.flush()
