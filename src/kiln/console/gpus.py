"""GPU memory and utilisation for the console, read through the metrics frontend's NVML collector."""

from __future__ import annotations

import threading
from typing import Any

from kiln.frontends.metrics_gpu import GpuCollector, Nvml, gpu_collector

_FIELDS = {"nv_gpu_utilization": "utilization", "nv_gpu_memory_total_bytes": "memory_total_bytes",
           "nv_gpu_memory_used_bytes": "memory_used_bytes", "nv_gpu_power_usage": "power_w"}


class GpuReader:
    """Opens NVML the first time it is read (never at import: a server nobody watches does not pay for it)."""

    def __init__(self, nvml: Nvml | None = None) -> None:
        self._nvml = nvml  # None: pynvml, if installed
        self._lock = threading.Lock()
        self._opened = False
        self._collector: GpuCollector | None = None

    def __call__(self) -> list[dict[str, Any]]:
        """One entry per visible GPU; an empty list without NVML or a GPU."""
        with self._lock:
            if not self._opened:
                self._collector, self._opened = gpu_collector(self._nvml), True
            collector = self._collector
        if collector is None:
            return []
        gpus: dict[str, dict[str, Any]] = {}
        for family in collector.collect():
            field = _FIELDS.get(family.name)
            for sample in family.samples if field else ():
                uuid = sample.labels["gpu_uuid"]
                gpus.setdefault(uuid, {"uuid": uuid})[field] = sample.value  # type: ignore[index]
        return list(gpus.values())
