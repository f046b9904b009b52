"""What every model of a server answered while one of them was measured (``kiln bench compare``'s "all models
together", and the batches it ran them in): the server's counts, read in the background while the bench runs and
matched to the span of the windows it kept, so start-up, warm-up and the windows it discarded do not dilute the
rates."""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from typing import NamedTuple

from kiln.errors import KilnError, UnavailableError
from kiln.v2.client import HttpClient

STATS_TIMEOUT_S = 30.0
SAMPLE_INTERVAL_S = 0.1  # a 3 s span is then placed within about 3% at either end


class _Counts(NamedTuple):
    """Per model (every version): requests answered, rows inferred, executions (batches) run."""

    requests: dict[str, int]
    rows: dict[str, int]
    executions: dict[str, int]


def served_counts(http_url: str) -> dict[str, int]:
    """Requests each model of a server has answered so far (every version), from the statistics extension."""
    return _read_counts(http_url).requests


def _read_counts(http_url: str) -> _Counts:
    try:
        with HttpClient(http_url, timeout_s=STATS_TIMEOUT_S) as client:
            entries = client.statistics()["model_stats"]
    except KilnError as exc:
        raise UnavailableError(f"kiln bench compare could not read the server's statistics at {http_url}: "
                               f"{exc.message}") from None
    counts = _Counts({}, {}, {})
    for entry in entries:
        name = entry["name"]
        for series, value in ((counts.requests, entry["inference_stats"]["success"]["count"]),
                              (counts.rows, entry.get("inference_count", 0)),
                              (counts.executions, entry.get("execution_count", 0))):
            series[name] = series.get(name, 0) + int(value)
    return counts


class CountSampler:
    """Reads ``served_counts`` every ``interval_s`` on a thread, stamped with ``time.monotonic_ns`` (the clock the
    bench stamps its windows with), from the first reading in ``start`` to the last in ``stop``."""

    def __init__(self, http_url: str, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self._url = http_url
        self._interval_s = interval_s
        self._times: list[int] = []
        self._counts: list[_Counts] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: UnavailableError | None = None

    def start(self) -> None:
        self._read()  # a server that cannot be read fails here, before any load runs
        self._thread = threading.Thread(target=self._run, name="kiln-bench-served-counts", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop reading (one last reading first); raises UnavailableError if a reading failed meanwhile."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._failure is not None:
            raise self._failure
        self._read()

    def rates(self, start_ns: int, end_ns: int) -> dict[str, float]:
        """Requests/s per model between two instants inside the sampled time, each count interpolated between
        the readings around it."""
        grown = self._grown(start_ns, end_ns, 0)
        seconds = (end_ns - start_ns) / 1e9
        return {name: count / seconds for name, count in grown.items()}

    def rows_per_execution(self, start_ns: int, end_ns: int) -> dict[str, float]:
        """The average batch per model between two instants (rows inferred per execution), for the models that
        ran a batch meanwhile."""
        rows, executions = self._grown(start_ns, end_ns, 1), self._grown(start_ns, end_ns, 2)
        return {name: rows.get(name, 0.0) / count for name, count in executions.items() if count > 0}

    def _grown(self, start_ns: int, end_ns: int, series: int) -> dict[str, float]:
        """How much each model's count of ``series`` (a field of _Counts) grew between two instants."""
        if not self._times or start_ns < self._times[0] or end_ns > self._times[-1] or end_ns <= start_ns:
            raise ValueError(f"the span {start_ns}..{end_ns} ns is not inside the sampled "
                             f"{self._times[:1]}..{self._times[-1:]} ns")
        first, last = self._at(start_ns, series), self._at(end_ns, series)
        return {name: count - first.get(name, 0.0) for name, count in last.items()}

    def _at(self, when_ns: int, series: int) -> dict[str, float]:
        after = min(bisect_left(self._times, when_ns), len(self._times) - 1)
        before = max(after - 1, 0)
        t0, t1 = self._times[before], self._times[after]
        share = (when_ns - t0) / (t1 - t0) if t1 > t0 else 1.0
        old, new = self._counts[before][series], self._counts[after][series]
        return {name: old.get(name, 0) + (count - old.get(name, 0)) * share for name, count in new.items()}

    def _read(self) -> None:
        sent = time.monotonic_ns()
        counts = _read_counts(self._url)
        self._times.append((sent + time.monotonic_ns()) // 2)  # the server read its counts in between
        self._counts.append(counts)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._read()
            except UnavailableError as exc:
                self._failure = exc
                return
