"""Step-by-step progress of a build on stderr, and the time each step took (which goes into the report)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO


class Progress:
    """Prints one line per step ("calibrating ... 5.7 s"); counted steps update in place on a terminal."""

    def __init__(self, enabled: bool = True, stream: TextIO | None = None) -> None:
        self._enabled = enabled
        self._stream = stream if stream is not None else sys.stderr
        self.timings: dict[str, float] = {}

    @contextmanager
    def step(self, key: str, title: str, total: int | None = None) -> Iterator[Callable[[int], None]]:
        """Time a step named ``key``; the yielded callback reports how many of ``total`` units are done."""
        start = time.perf_counter()
        live = self._enabled and self._stream.isatty()
        self._write(f"kiln build: {title} ...", end="" if live else "\n")

        def advance(done: int) -> None:
            if live and total:
                self._write(f"\rkiln build: {title} ... {done}/{total}", end="")

        try:
            yield advance
        finally:
            elapsed = time.perf_counter() - start
            self.timings[key] = round(self.timings.get(key, 0.0) + elapsed, 3)
            if live:
                counted = f" {total}/{total}" if total else ""
                self._write(f"\rkiln build: {title} ...{counted} {elapsed:.1f} s")
            else:
                self._write(f"kiln build: {title}: done in {elapsed:.1f} s")

    def note(self, message: str) -> None:
        self._write(f"kiln build: {message}")

    def _write(self, text: str, end: str = "\n") -> None:
        if self._enabled:
            self._stream.write(text + end)
            self._stream.flush()
