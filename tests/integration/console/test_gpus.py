"""The console's GPU figures: NVML's readings through the metrics frontend's collector."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from kiln.console.gpus import GpuReader
from kiln.frontends.metrics_gpu import gpu_collector


class OneGpuNvml:
    """pynvml's surface for one GPU that reports no power (NVML cannot run on a machine without a GPU)."""

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        self.inits = 0

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return "GPU-cafe-0001"

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=42, memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(total=80 * 2**30, used=3 * 2**30, free=0)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        raise self.NVMLError("Not Supported")

    def nvmlDeviceGetPowerManagementLimit(self, handle: int) -> int:
        raise self.NVMLError("Not Supported")

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        raise self.NVMLError("Not Supported")


def test_readings_per_gpu_and_nvml_opened_once_at_first_read() -> None:
    nvml = OneGpuNvml()
    reader = GpuReader(nvml)  # type: ignore[arg-type]
    assert nvml.inits == 0
    for _ in range(2):
        assert reader() == [{"uuid": "GPU-cafe-0001", "utilization": 0.42, "memory_total_bytes": 80 * 2**30,
                             "memory_used_bytes": 3 * 2**30}]
    assert nvml.inits == 1


@pytest.mark.gpu
def test_readings_through_real_nvml() -> None:
    if importlib.util.find_spec("pynvml") is None:
        pytest.skip("pynvml (package nvidia-ml-py) is not installed")
    if gpu_collector() is None:
        pytest.skip("NVML is not usable here: no NVIDIA driver or no visible GPU")
    for gpu in GpuReader()():
        assert gpu["uuid"].startswith(("GPU-", "MIG-")) and 0 <= gpu["utilization"] <= 1
        assert 0 < gpu["memory_used_bytes"] <= gpu["memory_total_bytes"]
