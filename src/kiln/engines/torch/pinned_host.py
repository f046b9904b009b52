"""Request rows copied to the device straight from shared host memory (kiln.engines.host_memory).

A batch's rows normally go through the lane's pinned staging buffer: one host copy into it, then one asynchronous
copy to the device (staging.py). Rows that a frontend worker wrote into a shared-memory arena can skip the first
copy: the arena is page-locked once (``cudaHostRegister``), and each request's rows are copied to the device from
where they lie, asynchronously, like the staging buffer's. For `kiln serve` on a GPU that copy was a fifth of the
server process's event loop (benchmarks/results/served_core_profile-h100-2026-12-05.md).

Registering pins the whole buffer: its pages are taken at once and stay in memory until the buffer is closed (64 MiB
per worker's request arena, and the size of each client's region). Page-locked memory is taken from what the rest of
the machine can use, so buffers are pinned only while the total stays within ``PINNED_LIMIT_BYTES`` (a quarter of
the host's memory); a buffer past it, or one that fails to pin, is not tried again while it is listed, and its rows
are staged as before. Closing a buffer waits for the devices that copied from it, then unpins it, before its owner
unmaps it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kiln.engines import host_memory

log = logging.getLogger(__name__)
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process, not only the current one
PINNED_LIMIT_BYTES = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


@dataclass
class _Pinned:
    whole: torch.Tensor | None  # uint8 over the whole buffer; None where pinning failed
    devices: set[int] = field(default_factory=set)


_lock = threading.Lock()
_pinned: dict[host_memory.SharedHost, _Pinned] = {}  # until the buffer is closed
_pinned_bytes = 0


class HostRows:
    """A batch input's rows as pieces of pinned shared memory, copied back to back into the graph's static input."""

    __slots__ = ("pieces", "rows", "nbytes")

    def __init__(self, pieces: list[torch.Tensor], rows: int) -> None:
        self.pieces = pieces
        self.rows = rows
        self.nbytes = sum(int(piece.numel()) for piece in pieces)

    def copy_into(self, static: torch.Tensor) -> None:
        """Queue the copies on the current stream; ``static`` must be contiguous and hold exactly these bytes."""
        flat = static.view(-1).view(torch.uint8)
        if flat.numel() != self.nbytes:
            raise ValueError(f"a static input of {flat.numel()} bytes cannot take {self.nbytes} bytes of rows")
        if len(self.pieces) == 1:
            flat.copy_(self.pieces[0], non_blocking=True)
            return
        # One call for every piece, not one per request of the batch: each torch call from Python lets go of the GIL
        # and takes it back, and on a busy event loop that can mean waiting for another thread.
        targets = torch.split_with_sizes(flat, [int(piece.numel()) for piece in self.pieces])
        torch._foreach_copy_(targets, self.pieces, non_blocking=True)


def host_rows(arrays: Sequence[npt.NDArray[Any]], dtype: np.dtype[Any], device: torch.device) -> HostRows | None:
    """``arrays`` (a batch's parts of one input, in the model's dtype and shape) as pieces of pinned shared memory,
    or None unless every one of them lies, contiguous and in ``dtype``, in a listed buffer that could be pinned.
    Parts that follow each other in the buffer (a worker's requests in consecutive arena slots) make one piece:
    one copy instead of several."""
    runs: list[tuple[torch.Tensor, int, int]] = []  # (a pinned buffer, start, stop) in bytes
    rows = 0
    last: host_memory.SharedHost | None = None
    whole: torch.Tensor | None = None
    for array in arrays:
        if array.dtype != dtype or not array.flags.c_contiguous or array.ndim == 0:
            return None
        address = array.ctypes.data  # half the cost of __array_interface__
        shared = host_memory.containing(address, array.nbytes)
        if shared is None:
            return None
        if shared is not last:  # a batch's parts mostly lie in one or a few buffers
            last, whole = shared, _whole(shared, device)
        if whole is None:
            return None
        start = address - shared.address
        if runs and runs[-1][0] is whole and runs[-1][2] == start:
            runs[-1] = (whole, runs[-1][1], start + array.nbytes)
        else:
            runs.append((whole, start, start + array.nbytes))
        rows += int(array.shape[0])
    return HostRows([whole[start:stop] for whole, start, stop in runs], rows)


def _whole(shared: host_memory.SharedHost, device: torch.device) -> torch.Tensor | None:
    with _lock:
        pinned = _pinned.get(shared)
        fresh = pinned is None
        if pinned is None:
            pinned = _Pinned(_pin(shared))
            _pinned[shared] = pinned
        if pinned.whole is not None:
            pinned.devices.add(device.index if device.index is not None else torch.cuda.current_device())
        whole = pinned.whole
    if fresh:
        # Outside the lock: a buffer closed meanwhile runs _unpin at once, which takes the lock. (This batch's copy
        # then reads memory no longer locked but still mapped, as a pageable copy.) It also forgets a buffer that
        # could not be pinned.
        shared.on_close(_unpin)
    return whole


def _pin(shared: host_memory.SharedHost) -> torch.Tensor | None:
    """Called with ``_lock`` held."""
    global _pinned_bytes
    if _pinned_bytes + shared.size > PINNED_LIMIT_BYTES:
        log.warning("not page-locking a shared buffer of %d bytes: %d bytes are locked already, and the limit is %d; "
                    "requests in it are staged through a pinned copy instead", shared.size, _pinned_bytes,
                    PINNED_LIMIT_BYTES)
        return None
    error = _cudart().cudaHostRegister(shared.address, shared.size, _PORTABLE)
    if int(error) != 0:
        log.warning("could not page-lock a shared buffer of %d bytes (CUDA error %s); requests in it are staged "
                    "through a pinned copy instead", shared.size, error)
        return None
    _pinned_bytes += shared.size
    return torch.frombuffer(shared.buffer, dtype=torch.uint8)


def _unpin(shared: host_memory.SharedHost) -> None:
    global _pinned_bytes
    with _lock:
        pinned = _pinned.pop(shared, None)
    if pinned is None or pinned.whole is None:
        return
    for index in sorted(pinned.devices):  # no copy from the buffer may still be running once it is unpinned
        torch.cuda.synchronize(index)
    pinned.whole = None
    _cudart().cudaHostUnregister(shared.address)
    with _lock:
        _pinned_bytes -= shared.size


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]  # torch leaves it unannotated


def pinned_count() -> int:
    """Shared buffers currently page-locked (for tests and diagnostics)."""
    with _lock:
        return sum(1 for pinned in _pinned.values() if pinned.whole is not None)
