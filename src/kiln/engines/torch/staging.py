"""Host staging: one reusable buffer per input, into which each request's rows are copied once.

On a CUDA engine the buffer is pinned (page-locked), so the one host-to-device copy per batch that follows runs
asynchronously on the caller's stream; a fresh pinned buffer per batch would cost a page-locking allocation, and
concatenating requests first would copy every byte twice. On the CPU the same class works unpinned, which is how
its row bookkeeping is tested without a GPU.

A large batch is copied by torch rather than numpy, in one ``torch.cat`` into the buffer: torch splits a large
copy over its intra-op threads, numpy copies on one core, and one call gives up the GIL once per batch instead of
once per request (each time it is taken back, the thread may wait for the event loop's turn to end; on an H200
host this made two-instance serving 15-25% faster). A batch of 64 FP32 images is 38 MB; served on an H200 host
with numpy copies, such a batch spent about 10.6 ms in compute_infer against about 4.5 ms that the GPU needs for
ResNet-50 at that size. Small fills (one direct caller's request) stay with numpy: many threads each opening a
team of intra-op threads would oversubscribe the cores that those callers already keep busy.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import torch

_BF16 = np.dtype(ml_dtypes.bfloat16)
PARALLEL_COPY_BYTES = 4 << 20  # a fill at least this large is copied by torch's intra-op threads

# torch.from_numpy warns, once per process, that a read-only array gives a writable tensor; staging only reads it.
_READ_ONLY_WARNING = "The given NumPy array is not writable"
_read_only_seen = False


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
        offset = 0
        buffer = self._buffer
        assert buffer is not None
        parallel = total * view[0].nbytes >= PARALLEL_COPY_BYTES  # view[0] is one row
        if parallel and view.dtype != _BF16 and all(a.dtype == view.dtype and a.flags.c_contiguous for a in arrays):
            # One call for the whole batch: intra-op threads copy while this thread waits once without the GIL.
            torch.cat([_source(array) for array in arrays], out=buffer[:total])
            return buffer[:total]
        for array in arrays:  # numpy, on one core (casting, keeping bfloat16 bits)
            rows = int(array.shape[0])
            view[offset:offset + rows] = array
            offset += rows
        return buffer[:total]

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


def _source(array: npt.NDArray[Any]) -> torch.Tensor:
    """A tensor over ``array``'s memory, to copy from."""
    global _read_only_seen
    if array.flags.writeable or _read_only_seen:
        return torch.from_numpy(array)
    with warnings.catch_warnings():  # only around the first read-only array: torch stays silent after it
        warnings.filterwarnings("ignore", message=_READ_ONLY_WARNING, category=UserWarning)
        tensor = torch.from_numpy(array)
    _read_only_seen = True
    return tensor


def numpy_view(tensor: torch.Tensor) -> npt.NDArray[Any]:
    """A numpy array over a CPU tensor's memory (bfloat16 through its 16-bit patterns, which ml_dtypes shares)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(_BF16)
    return tensor.numpy()
