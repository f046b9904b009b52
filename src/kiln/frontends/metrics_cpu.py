"""Triton's host metrics: ``nv_cpu_utilization``, ``nv_cpu_memory_total_bytes``, ``nv_cpu_memory_used_bytes``.

Same semantics as Triton's Linux ``/proc`` reader, through psutil:

- utilization = busy / (busy + idle) over the time since the previous scrape (the first scrape: since the
  collector was made), where busy = user + nice + system + irq + softirq + steal and idle = idle + iowait
  (guest time is already inside user time);
- used memory = MemTotal - MemAvailable.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import psutil
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_BUSY = ("user", "nice", "system", "irq", "softirq", "steal")
_IDLE = ("idle", "iowait")


def _split(times: Any) -> tuple[float, float]:
    """(busy, idle) seconds of a ``psutil.cpu_times()`` result; fields a platform lacks count as 0."""
    busy = sum(float(getattr(times, name, 0.0)) for name in _BUSY)
    idle = sum(float(getattr(times, name, 0.0)) for name in _IDLE)
    return busy, idle


class CpuCollector(Collector):
    def __init__(self, cpu_times: Callable[[], Any] = psutil.cpu_times,
                 virtual_memory: Callable[[], Any] = psutil.virtual_memory) -> None:
        self._cpu_times = cpu_times
        self._virtual_memory = virtual_memory
        self._lock = threading.Lock()
        self._last = _split(cpu_times())
        self._utilization = 0.0

    def utilization(self) -> float:
        """Busy share of all CPUs since the previous call, 0..1 (the previous value when no tick has passed)."""
        now = _split(self._cpu_times())
        with self._lock:
            busy = now[0] - self._last[0]
            total = busy + now[1] - self._last[1]
            if total > 0:
                self._utilization = min(1.0, max(0.0, busy / total))
                self._last = now
            return self._utilization

    def collect(self) -> Iterator[Metric]:
        memory = self._virtual_memory()
        total = int(memory.total)
        used = total - int(memory.available)
        yield GaugeMetricFamily("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", value=self.utilization())
        yield GaugeMetricFamily("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", value=total)
        yield GaugeMetricFamily("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", value=used)
