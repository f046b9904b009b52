"""The progress display: a line per window into a log, one line updated in place on a terminal, nothing when quiet."""

from __future__ import annotations

import io

from kiln.bench.measure import Window
from kiln.bench.progress import Progress
from kiln.bench.records import Level

MS = 1_000_000


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def window(count: int, latency_ms: float, errors: int = 0) -> Window:
    """One second holding ``count`` requests of ``latency_ms`` each."""
    return Window(0, 1000 * MS, (int(latency_ms * MS),) * count, errors, 0, 0, 1, None, None)


def test_a_log_gets_a_line_per_window_and_stable_once_three_agree() -> None:
    log = io.StringIO()
    progress = Progress(stream=log, stability_percentage=10, max_trials=5)
    windows = [window(100, 2.0), window(50, 4.0, errors=2), window(100, 2.0), window(101, 2.0), window(100, 2.0)]
    for seen in range(1, len(windows) + 1):
        progress.window(Level(concurrency=4), windows[:seen])
    lines = log.getvalue().splitlines()
    assert lines[0] == "kiln bench: concurrency 4: window 1/5: 100.0 infer/s, avg 2.000 ms"
    assert lines[1] == "kiln bench: concurrency 4: window 2/5: 50.0 infer/s, avg 4.000 ms, 2 errors"
    assert [line.endswith(", stable") for line in lines] == [False, False, False, False, True]


def test_a_terminal_gets_one_line_rewritten_and_closed_at_the_level_end() -> None:
    terminal = Terminal()
    progress = Progress(stream=terminal, max_trials=3)
    progress.window(Level(request_rate=50.0, distribution="poisson"), [window(50, 1.0)])
    progress.window(Level(request_rate=50.0, distribution="poisson"), [window(50, 1.0), window(49, 1.0)])
    progress.end_level()
    progress.note("done")
    assert terminal.getvalue() == (
        "\rkiln bench: request rate 50/s (poisson): window 1/3: 50.0 infer/s, avg 1.000 ms"
        "\rkiln bench: request rate 50/s (poisson): window 2/3: 49.0 infer/s, avg 1.000 ms"
        "\nkiln bench: done\n")


def test_quiet_writes_nothing() -> None:
    log = Terminal()
    progress = Progress(enabled=False, stream=log)
    progress.window(Level(concurrency=1), [window(10, 1.0)])
    progress.note("hello")
    progress.end_level()
    assert log.getvalue() == ""
