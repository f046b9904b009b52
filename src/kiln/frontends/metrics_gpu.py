"""Triton's per-GPU metrics through NVML (the optional ``nvidia-ml-py`` package, module ``pynvml``).

``nv_gpu_utilization`` (0..1), ``nv_gpu_memory_total_bytes``, ``nv_gpu_memory_used_bytes``, ``nv_gpu_power_usage``
(W), ``nv_gpu_power_limit`` (W) and the counter ``nv_energy_consumption`` (J since the collector started), each
labelled ``gpu_uuid``. Triton reads the same fields through DCGM. Only GPUs that CUDA_VISIBLE_DEVICES leaves
visible are reported (entries as NVML indices or ``GPU-`` UUID prefixes), as Triton reports only the GPUs it can
use. Without pynvml, an NVIDIA driver or a visible GPU the collector is simply absent; a field a GPU does not
support (power on some boards, say) is left out for that GPU.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("kiln.metrics")
T = TypeVar("T")


class _Utilization(Protocol):
    gpu: int  # percent


class _Memory(Protocol):
    total: int
    used: int


class Nvml(Protocol):
    """The part of pynvml this module uses (pynvml ships no type information)."""

    NVMLError: type[Exception]

    def nvmlInit(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> object: ...
    def nvmlDeviceGetUUID(self, handle: object) -> str | bytes: ...
    def nvmlDeviceGetUtilizationRates(self, handle: object) -> _Utilization: ...
    def nvmlDeviceGetMemoryInfo(self, handle: object) -> _Memory: ...
    def nvmlDeviceGetPowerUsage(self, handle: object) -> int: ...  # mW
    def nvmlDeviceGetPowerManagementLimit(self, handle: object) -> int: ...  # mW
    def nvmlDeviceGetTotalEnergyConsumption(self, handle: object) -> int: ...  # mJ since the driver loaded


@dataclass(frozen=True)
class _Gpu:
    uuid: str
    handle: object
    energy_base_mj: float | None  # None: the GPU does not report energy


def import_nvml() -> Nvml | None:
    """pynvml when it is installed, else None. The deprecated ``pynvml`` shim package warns on import: muted."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return cast(Nvml, importlib.import_module("pynvml"))
    except ImportError:
        return None


def visible(index: int, uuid: str, cuda_visible_devices: str | None) -> bool:
    if cuda_visible_devices is None:
        return True
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if entry == str(index) or (entry.startswith("GPU-") and uuid.startswith(entry)):
            return True
    return False


def gpu_collector(nvml: Nvml | None = None) -> GpuCollector | None:
    """A collector for the visible GPUs, or None when NVML or a GPU is missing (never raises)."""
    nvml = nvml if nvml is not None else import_nvml()
    if nvml is None:
        return None
    try:
        nvml.nvmlInit()
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            if visible(index, uuid, os.environ.get("CUDA_VISIBLE_DEVICES")):
                energy = _read(nvml, functools.partial(nvml.nvmlDeviceGetTotalEnergyConsumption, handle))
                gpus.append(_Gpu(uuid, handle, energy))
    except Exception as exc:  # NVMLError (no driver, no library) or anything else: GPU metrics are optional
        log.debug("GPU metrics are off: NVML is not usable (%s)", exc)
        return None
    return GpuCollector(nvml, gpus) if gpus else None


class GpuCollector(Collector):
    def __init__(self, nvml: Nvml, gpus: list[_Gpu]) -> None:
        self._nvml = nvml
        self._gpus = gpus

    @property
    def uuids(self) -> list[str]:
        return [gpu.uuid for gpu in self._gpus]

    def collect(self) -> Iterator[Metric]:
        nvml = self._nvml
        families = {
            "utilization": GaugeMetricFamily("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)",
                                             labels=["gpu_uuid"]),
            "memory_total": GaugeMetricFamily("nv_gpu_memory_total_bytes", "GPU total memory, in bytes",
                                              labels=["gpu_uuid"]),
            "memory_used": GaugeMetricFamily("nv_gpu_memory_used_bytes", "GPU used memory, in bytes",
                                             labels=["gpu_uuid"]),
            "power_usage": GaugeMetricFamily("nv_gpu_power_usage", "GPU power usage in watts", labels=["gpu_uuid"]),
            "power_limit": GaugeMetricFamily("nv_gpu_power_limit", "GPU power management limit in watts",
                                             labels=["gpu_uuid"]),
        }
        energy = Metric("nv_energy_consumption", "GPU energy consumption in joules since kiln started", "counter")
        for gpu in self._gpus:
            for key, value in self._readings(gpu).items():
                if value is not None:
                    families[key].add_metric([gpu.uuid], value)
            now_mj = _read(nvml, functools.partial(nvml.nvmlDeviceGetTotalEnergyConsumption, gpu.handle))
            if gpu.energy_base_mj is not None and now_mj is not None:
                energy.add_sample("nv_energy_consumption", {"gpu_uuid": gpu.uuid},
                                  max(0.0, now_mj - gpu.energy_base_mj) / 1000)
        yield from families.values()
        yield energy

    def _readings(self, gpu: _Gpu) -> dict[str, float | None]:
        nvml, h = self._nvml, gpu.handle
        utilization = _call(nvml, lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu)
        memory = _call(nvml, lambda: nvml.nvmlDeviceGetMemoryInfo(h))
        power = _call(nvml, lambda: nvml.nvmlDeviceGetPowerUsage(h))
        limit = _call(nvml, lambda: nvml.nvmlDeviceGetPowerManagementLimit(h))
        return {
            "utilization": None if utilization is None else utilization / 100,
            "memory_total": None if memory is None else float(memory.total),
            "memory_used": None if memory is None else float(memory.used),
            "power_usage": None if power is None else power / 1000,
            "power_limit": None if limit is None else limit / 1000,
        }


def _read(nvml: Nvml, call: Callable[[], float]) -> float | None:
    value = _call(nvml, call)
    return None if value is None else float(value)


def _call(nvml: Nvml, call: Callable[[], T]) -> T | None:
    """One NVML call, or None when the GPU does not support it or NVML fails for this call."""
    try:
        return call()
    except nvml.NVMLError:
        return None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
