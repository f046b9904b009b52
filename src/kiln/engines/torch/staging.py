"""Host staging: one reusable buffer per input, into which each request's rows are copied once.

On a CUDA engine the buffer is pinned (page-locked), so the one host-to-device copy per batch that follows runs
asynchronously on the caller's stream; a fresh pinned buffer per batch would cost a page-locking allocation, and
concatenating requests first would copy every byte twice. On the CPU the same class works unpinned, which is how
its row bookkeeping is tested without a GPU.

A large batch is copied by a few threads at once (the caller among them), each taking every k-th request (numpy
gives up the GIL while it copies). On an H200 host one thread copies about 12 GB/s into pinned memory; for a
launched batch of FP32 images the caller and two helpers, sharing from 1 MB on, beat four threads from 4 MB at
8, 16 and 32 images (336 against 405 us, 519 against 575, 986 against 1,064; benchmarks/results/
launch_cost-h200-2026-12-03.txt), and torch's own parallel copy (``torch.cat`` into the buffer, or one ``copy_``
per request) was slower still (staging_copy-h200-2026-12-03.txt). The copy is most of what a batch costs the
host. A fill of one request (a direct caller's) stays on the calling thread: many callers would oversubscribe
the cores they already keep busy.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import torch

_BF16 = np.dtype(ml_dtypes.bfloat16)
PARALLEL_COPY_BYTES = 1 << 20  # a fill at least this large is shared between COPY_THREADS threads
COPY_THREADS = min(3, (os.cpu_count() or 1) // 4)  # the caller and two helpers; below 2, the caller copies alone

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


class RowStaging:
    """A host buffer of ``row_shape`` per row (the whole shape when ``batching`` is False): an input staged for
    the device, or an output copied back from it.

    ``fill`` returns a tensor over the first rows of the buffer; it stays valid until the next ``fill``, so the
    owner (a lane) must finish the copy that reads it before filling again.
    """

    def __init__(self, dtype: torch.dtype, row_shape: tuple[int, ...], *, batching: bool, max_rows: int,
                 pinned: bool) -> None:
        self.dtype = dtype
        self.row_shape = row_shape
        self.batching = batching
        self.max_rows = max_rows  # 0 = no limit
        self.pinned = pinned
        self._buffer: torch.Tensor | None = None
        self._rows = 0
        self._view: npt.NDArray[Any] | None = None

    @property
    def capacity(self) -> int:
        """Rows the current buffer holds (0 before the first fill)."""
        return self._rows

    def fill(self, arrays: Sequence[npt.NDArray[Any]]) -> torch.Tensor:
        """Copy ``arrays`` (each of shape ``(rows, *row_shape)``, or the whole shape without batching) back to back
        into the buffer; return the filled part as a tensor."""
        if not self.batching:
            (array,) = arrays
            view = self._reserve(1)
            view[0] = array
            return self.rows(1)
        total = sum(int(a.shape[0]) for a in arrays)
        view = self._reserve(total)
        placed: list[tuple[npt.NDArray[Any], npt.NDArray[Any]]] = []  # (rows of the buffer, a request's rows)
        offset = 0
        for array in arrays:
            rows = int(array.shape[0])
            placed.append((view[offset:offset + rows], array))
            offset += rows
        threads = min(COPY_THREADS, len(placed))
        if threads > 1 and total * view[0].nbytes >= PARALLEL_COPY_BYTES:  # view[0]: one row
            # The calling thread copies a share too, rather than idling until the helpers are done.
            helpers = [_copy_pool().submit(_copy_all, placed[i::threads]) for i in range(1, threads)]
            try:
                _copy_all(placed[::threads])
            finally:
                futures.wait(helpers)  # no share may still be writing once fill returns or raises
            for helper in helpers:
                helper.result()  # re-raises a failed copy here
        else:
            _copy_all(placed)
        assert self._buffer is not None
        return self._buffer[:total]

    def rows(self, count: int) -> torch.Tensor:
        """The first ``count`` rows of the buffer, grown first if it holds fewer (the whole shape without
        batching): somewhere to copy a result into."""
        self._reserve(count if self.batching else 1)
        assert self._buffer is not None
        return self._buffer[:count] if self.batching else self._buffer[0]

    def _reserve(self, rows: int) -> npt.NDArray[Any]:
        if rows > self._rows or self._view is None:
            grown = max(rows, 2 * self._rows)
            if self.max_rows:
                grown = max(rows, min(grown, self.max_rows))
            self._buffer = torch.empty((grown, *self.row_shape), dtype=self.dtype, pin_memory=self.pinned)
            self._view = numpy_view(self._buffer)
            self._rows = grown
        return self._view


def _copy_all(placed: Sequence[tuple[npt.NDArray[Any], npt.NDArray[Any]]]) -> None:
    for target, source in placed:
        target[...] = source  # numpy: casts, keeps bfloat16 bits, and lets other threads run while it copies


def _copy_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, COPY_THREADS - 1), thread_name_prefix="kiln-staging")
        return _pool


def numpy_view(tensor: torch.Tensor) -> npt.NDArray[Any]:
    """A numpy array over a CPU tensor's memory (bfloat16 through its 16-bit patterns, which ml_dtypes shares)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(_BF16)
    return tensor.numpy()
