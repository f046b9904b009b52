"""How much GPU memory a built engine took while it was verified, and how many instances of it fit on the GPU.

A GPU build's config asks for two instances (see output.py), each with its own weights and CUDA graphs. On a
small GPU two copies of a large engine may not fit, so the build measures one: the growth of PyTorch's reserved
memory from before the engine was loaded to the peak of its verification, and keeps as many instances as fit in
half of the GPU's memory (at least one). Engines whose memory PyTorch does not manage (TensorRT) measure as zero
and keep the config as generated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

FIT_SHARE = 0.5  # of the GPU's memory that the config's instances may take together


@dataclass
class GpuFootprint:
    engine_bytes: int | None = None  # None: not measured (no CUDA, or the build is for the CPU)
    total_bytes: int | None = None


@contextlib.contextmanager
def measure_footprint(device: str) -> Iterator[GpuFootprint]:
    """Measure the GPU memory PyTorch reserves for what runs inside the block (on ``cuda`` builds only)."""
    footprint = GpuFootprint()
    torch = _cuda_torch() if device == "cuda" else None
    if torch is None:
        yield footprint
        return
    try:
        torch.cuda.empty_cache()  # blocks cached by the build itself would otherwise hide the engine's growth
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_reserved()
    except RuntimeError:  # a figure the build can do without: the config stays as generated
        yield footprint
        return
    yield footprint
    try:
        footprint.total_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        footprint.engine_bytes = max(0, torch.cuda.max_memory_reserved() - before)
    except RuntimeError:
        footprint.engine_bytes = footprint.total_bytes = None


def instances_that_fit(footprint: GpuFootprint, wanted: int) -> int:
    """``wanted`` when that many copies fit in FIT_SHARE of the GPU (or nothing was measured), else fewer, >= 1."""
    engine, total = footprint.engine_bytes, footprint.total_bytes
    if not engine or not total:
        return wanted
    return max(1, min(wanted, int(total * FIT_SHARE // engine)))


def _cuda_torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None
