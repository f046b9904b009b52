"""Measurement windows and perf_analyzer's stability rule.

A level runs its load without pause while back-to-back windows of ``measurement_interval`` are cut from it. A
window counts the requests that completed inside it, wherever they started (perf_analyzer's time windows), so a
request in flight at a boundary counts in the window where it ends. The level is stable once the last 3 windows
agree: max/min of their throughputs and of their average latencies are each within 1 + stability_percentage/100,
and none has zero throughput. Measuring stops there or after ``max_trials`` windows; the result merges the last 3
windows (all of them when fewer ran).

A window that counts fewer than ``MIN_WINDOW_REQUESTS`` (a slow model at low concurrency) makes the next windows
twice as long (perf_analyzer asks the user for a larger window instead). The windows actually used are in the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kiln.bench.records import Level, Recorder, RequestRecord
from kiln.bench.resources import MemoryFigures
from kiln.bench.schedule import SendCounts
from kiln.bench.server_stats import ServerCounters
from kiln.bench.stats import LatencySummary, summarize, throughput_per_s

STABILITY_WINDOWS = 3
MIN_WINDOW_REQUESTS = 3


class Load(Protocol):
    """What a target offers the measurement: generate load in the background, stop it, read server counters."""

    def start(self, level: Level, recorder: Recorder) -> None: ...

    def stop(self) -> SendCounts | None: ...

    def server_stats(self) -> ServerCounters | None: ...


class MemoryMeter(Protocol):
    def start_level(self) -> None: ...

    def sample(self) -> None: ...

    def stop_level(self) -> MemoryFigures: ...


@dataclass(frozen=True)
class Settings:
    interval_ns: int
    stability_percentage: float = 10.0
    max_trials: int = 10


@dataclass(frozen=True)
class Window:
    start_ns: int
    end_ns: int
    latencies_ns: tuple[int, ...]  # successful requests that ended inside the window
    errors: int  # failed requests that ended inside the window
    send_ns: int  # client send time summed over the counted requests that report it
    recv_ns: int
    client_count: int
    server_before: ServerCounters | None
    server_after: ServerCounters | None

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def count(self) -> int:
        return len(self.latencies_ns)

    @property
    def throughput_per_s(self) -> float:
        return throughput_per_s(self.count, self.duration_ns)

    @property
    def avg_latency_ns(self) -> float:
        return sum(self.latencies_ns) / self.count if self.count else 0.0


def cut_window(records: Sequence[RequestRecord], start_ns: int, end_ns: int, server_before: ServerCounters | None,
               server_after: ServerCounters | None) -> Window:
    """A window from the records that ended by ``end_ns``: the successful ones that ended after ``start_ns``
    count, wherever they started; failures count as errors."""
    counted = [r for r in records if r.ok and start_ns < r.end_ns <= end_ns]
    timed = [r.client for r in counted if r.client is not None]
    return Window(start_ns=start_ns, end_ns=end_ns, latencies_ns=tuple(r.end_ns - r.start_ns for r in counted),
                  errors=sum(1 for r in records if not r.ok and r.end_ns <= end_ns),
                  send_ns=sum(t.send_ns for t in timed), recv_ns=sum(t.recv_ns for t in timed),
                  client_count=len(timed), server_before=server_before, server_after=server_after)


def is_stable(windows: Sequence[Window], percentage: float, size: int = STABILITY_WINDOWS) -> bool:
    """perf_analyzer's rule over the last ``size`` windows (see the module docstring)."""
    if len(windows) < size:
        return False
    last = windows[-size:]
    if any(w.count == 0 for w in last):
        return False
    limit = 1.0 + percentage / 100.0
    throughputs = [w.throughput_per_s for w in last]
    latencies = [w.avg_latency_ns for w in last]
    return max(throughputs) / min(throughputs) <= limit and max(latencies) / min(latencies) <= limit


@dataclass(frozen=True)
class Measurement:
    """One level's result before it is rendered: the merged windows, plus what the whole level saw."""

    level: Level
    windows: int
    stable: bool
    requests: int
    duration_ns: int
    latency: LatencySummary | None
    errors: int
    client_send_ns: float | None  # per request, over the merged windows
    client_recv_ns: float | None
    server: ServerCounters | None  # counter differences over the merged windows
    sends: SendCounts | None
    memory: MemoryFigures
    span_ns: tuple[int, int] | None = None  # the merged windows' start and end, on the measuring clock

    @property
    def throughput_per_s(self) -> float:
        return throughput_per_s(self.requests, self.duration_ns) if self.duration_ns > 0 else 0.0


def merge(level: Level, windows: Sequence[Window], stable: bool, sends: SendCounts | None,
          memory: MemoryFigures) -> Measurement:
    """Combine the last windows (3, or all when fewer) into the level's figures; errors count over every window."""
    if not windows:
        raise ValueError("merge needs at least one window")
    merged = windows[-STABILITY_WINDOWS:]
    latencies = [ns for w in merged for ns in w.latencies_ns]
    timed = sum(w.client_count for w in merged)
    first, last = merged[0], merged[-1]
    server = None
    if first.server_before is not None and last.server_after is not None:
        server = last.server_after - first.server_before
    return Measurement(
        level=level, windows=len(windows), stable=stable, requests=len(latencies),
        duration_ns=sum(w.duration_ns for w in merged), latency=summarize(latencies),
        errors=sum(w.errors for w in windows),
        client_send_ns=sum(w.send_ns for w in merged) / timed if timed else None,
        client_recv_ns=sum(w.recv_ns for w in merged) / timed if timed else None,
        server=server, sends=sends, memory=memory, span_ns=(first.start_ns, last.end_ns))


def _sleep_until(deadline_ns: int) -> None:
    remaining = deadline_ns - time.monotonic_ns()
    if remaining > 0:
        time.sleep(remaining / 1e9)


def measure_level(load: Load, level: Level, settings: Settings, memory: MemoryMeter,
                  on_window: Callable[[Sequence[Window]], None] | None = None,
                  clock: Callable[[], int] = time.monotonic_ns,
                  sleep_until: Callable[[int], None] = _sleep_until) -> Measurement:
    """Run ``level`` on ``load`` window after window until it is stable or ``max_trials`` windows ran."""
    recorder = Recorder()
    windows: list[Window] = []
    stable = False
    interval_ns = settings.interval_ns
    memory.start_level()
    try:
        load.start(level, recorder)  # inside: a load that fails to start still stops what it started
        start = clock()
        before = load.server_stats()
        while len(windows) < settings.max_trials and not stable:
            sleep_until(start + interval_ns)
            end = clock()
            records = recorder.take_until(end)
            after = load.server_stats()
            memory.sample()
            windows.append(cut_window(records, start, end, before, after))
            stable = is_stable(windows, settings.stability_percentage)
            if windows[-1].count < MIN_WINDOW_REQUESTS:
                interval_ns *= 2  # too short for this load's latency: lengthen the windows that follow
            if on_window is not None:
                on_window(windows)
            start, before = end, after
    finally:
        try:
            sends = load.stop()
        finally:
            figures = memory.stop_level()
    return merge(level, windows, stable, sends, figures)
