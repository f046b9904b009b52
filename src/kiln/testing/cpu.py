"""Keep the calling thread working for a given CPU time: for tests of what measures a thread's CPU (an event loop
that counts as busy, the per-process CPU metrics)."""

from __future__ import annotations

import time


def spin(cpu_s: float) -> None:
    """Return once the calling thread has used ``cpu_s`` seconds of CPU (its own, not the machine's wall time)."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass
