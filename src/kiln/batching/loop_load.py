"""How busy an event loop's thread is: the share of a core it used over the last window.

A loop that launches batches pays for each launch (staging the rows, replaying the graph) on its own thread. While
the thread has time to spare, a request that finds an instance free should start at once: waiting only adds
latency. Once the thread is the busy resource, every launch of a batch of one or two takes time the next requests
need, and requests then queue outside the loop (in sockets, in frontend workers) where the batcher cannot see
them: counting the rows in flight understates the load. The thread's own CPU time says it directly, at the cost
of one clock read per flush.
"""

from __future__ import annotations

import time
from collections.abc import Callable

WINDOW_S = 0.05  # long enough to span many launches, short enough to follow a change of load within a second
BUSY_SHARE = 0.75  # of one core: from here on, launches hold back small batches
CALM_SHARE = 0.5  # below it, they start at once again; the gap keeps a loop near one share from flapping


class LoopLoad:
    """Read from the loop's own thread only: ``cpu`` (``time.thread_time`` by default) is the calling thread's CPU
    time. The thresholds are read when one is made, from this module's constants unless given."""

    def __init__(self, window_s: float | None = None, busy_share: float | None = None,
                 calm_share: float | None = None, *, wall: Callable[[], float] = time.monotonic,
                 cpu: Callable[[], float] = time.thread_time) -> None:
        self.window_s = WINDOW_S if window_s is None else window_s
        self.busy_share = BUSY_SHARE if busy_share is None else busy_share
        self.calm_share = CALM_SHARE if calm_share is None else calm_share
        self._wall = wall
        self._cpu = cpu
        self._busy = False
        self._window_wall = wall()
        self._window_cpu = cpu()

    def busy(self) -> bool:
        """Whether the thread ran at ``busy_share`` of a core or more over the last full window (with hysteresis:
        once busy, until a window falls below ``calm_share``)."""
        now = self._wall()
        elapsed = now - self._window_wall
        if elapsed >= self.window_s:
            cpu = self._cpu()
            share = (cpu - self._window_cpu) / elapsed
            self._busy = share >= (self.calm_share if self._busy else self.busy_share)
            self._window_wall, self._window_cpu = now, cpu
        return self._busy
