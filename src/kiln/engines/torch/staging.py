"""Host staging: one reusable buffer per input, into which each request's rows are copied once.

On a CUDA engine the buffer is pinned (page-locked), so the one host-to-device copy per batch that follows runs
asynchronously on the caller's stream; a fresh pinned buffer per batch would cost a page-locking allocation, and
concatenating requests first would copy every byte twice. On the CPU the same class works unpinned, which is how
its row bookkeeping is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import torch

_BF16 = np.dtype(ml_dtypes.bfloat16)


class RowStaging:
    """A host buffer for one input of ``row_shape`` per row (the whole shape when ``batching`` is False).

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
            assert self._buffer is not None
            return self._buffer[0]
        total = sum(int(a.shape[0]) for a in arrays)
        view = self._reserve(total)
        offset = 0
        for array in arrays:
            rows = int(array.shape[0])
            view[offset:offset + rows] = array  # numpy copies without the GIL
            offset += rows
        assert self._buffer is not None
        return self._buffer[:total]

    def _reserve(self, rows: int) -> npt.NDArray[Any]:
        if rows > self._rows or self._view is None:
            grown = max(rows, 2 * self._rows)
            if self.max_rows:
                grown = max(rows, min(grown, self.max_rows))
            self._buffer = torch.empty((grown, *self.row_shape), dtype=self.dtype, pin_memory=self.pinned)
            self._view = numpy_view(self._buffer)
            self._rows = grown
        return self._view


def numpy_view(tensor: torch.Tensor) -> npt.NDArray[Any]:
    """A numpy array over a CPU tensor's memory (bfloat16 through its 16-bit patterns, which ml_dtypes shares)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(_BF16)
    return tensor.numpy()
