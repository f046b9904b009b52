"""A description of the machine a bench ran on, written into every result so numbers are never read without it."""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import os
import platform
import sys
from pathlib import Path
from typing import Any

from kiln import __version__

_PACKAGES = ("numpy", "onnxruntime", "torch", "tensorrt", "grpcio", "uvicorn", "uvloop")


def machine_info(gpu_memory_source: str | None = None) -> dict[str, Any]:
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu_model": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or "unknown",
        "cpu_count": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_total": _proc_field("/proc/meminfo", "MemTotal"),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "kiln": __version__,
        "packages": _packages(),
        "gpus": _gpu_names(),
        "gpu_memory_source": gpu_memory_source,
    }


def _proc_field(path: str, key: str) -> str | None:
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    return None


def _packages() -> dict[str, str]:
    found: dict[str, str] = {}
    for name in _PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def _gpu_names() -> list[str]:
    from kiln.bench.resources import import_nvml

    nvml = import_nvml()
    if nvml is None:
        return []
    names: list[str] = []
    with contextlib.suppress(Exception):  # NVML trouble only costs the GPU names
        for index in range(nvml.nvmlDeviceGetCount()):
            name = nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(index))
            names.append(name.decode() if isinstance(name, bytes) else str(name))
    return names
