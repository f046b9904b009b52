"""Request-rate mode's clock: when each send is due (constant or poisson gaps) and which sends went out late or not
at all; and the pool of request slots both load modes draw from.

The pacer keeps no clock of its own: the load loops pass the time in, so tests drive it with made-up times.
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass

import numpy as np

DELAY_TOLERANCE_NS = 1_000_000
"""A send that goes out more than 1 ms after its scheduled time counts as delayed. perf_analyzer (C++) counts any
lateness; a Python sender wakes up tens of microseconds late on a quiet machine, which is not a missed schedule."""


@dataclass(frozen=True)
class SendCounts:
    """What request-rate mode's schedule asked for and what it got."""

    scheduled: int
    delayed: int  # sent, but later than scheduled + tolerance
    dropped: int  # not sent: every request slot was busy when it was due


class Pacer:
    """Send times for ``rate_per_s`` requests per second from ``start_ns``: a fixed gap (constant) or exponential
    gaps with the same mean (poisson arrivals). The first send is due at ``start_ns``."""

    def __init__(self, rate_per_s: float, distribution: str, start_ns: int, seed: int = 0,
                 tolerance_ns: int = DELAY_TOLERANCE_NS) -> None:
        if rate_per_s <= 0:
            raise ValueError(f"request rate must be > 0, got {rate_per_s}")
        if distribution not in ("constant", "poisson"):
            raise ValueError(f"distribution must be constant or poisson, got {distribution!r}")
        self._mean_gap_ns = 1e9 / rate_per_s
        self._poisson = distribution == "poisson"
        self._rng = np.random.default_rng(seed)
        self._due = float(start_ns)
        self._tolerance_ns = tolerance_ns
        self.scheduled = 0
        self.delayed = 0
        self.dropped = 0

    @property
    def due_ns(self) -> int:
        """When the next send is due."""
        return int(self._due)

    def wait_ns(self, now_ns: int) -> int:
        """How long to wait from ``now_ns`` until the next send is due (0 when it is due or overdue)."""
        return max(0, self.due_ns - now_ns)

    def take(self, now_ns: int, slot_free: bool) -> int | None:
        """Account for the send due now and move the schedule on. Returns its scheduled time, or None when it is
        dropped because no request slot was free. Call only once ``wait_ns(now_ns)`` is 0."""
        due = self.due_ns
        self.scheduled += 1
        self._due += self._rng.exponential(self._mean_gap_ns) if self._poisson else self._mean_gap_ns
        if not slot_free:
            self.dropped += 1
            return None
        if now_ns - due > self._tolerance_ns:
            self.delayed += 1
        return due

    def counts(self) -> SendCounts:
        return SendCounts(self.scheduled, self.delayed, self.dropped)


class SlotPool:
    """Request slots 0..size-1 (a connection, a thread, an engine each); the lowest free one is handed out first,
    so a target only opens as many slots as the load actually keeps busy at once. Thread-safe."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {size}")
        self._free = list(range(size))
        self._lock = threading.Lock()

    def acquire(self) -> int | None:
        with self._lock:
            return heapq.heappop(self._free) if self._free else None

    def release(self, slot: int) -> None:
        with self._lock:
            heapq.heappush(self._free, slot)

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)
