"""``--input-memory shared``: the request tensors of an in-process run (direct, inprocess) placed in one shared host
buffer that is listed in kiln.engines.host_memory, as `kiln serve` lists its workers' arenas.

A GPU engine then copies rows to the device from where they lie (page-locked once), as it copies the rows of
requests from the workers, instead of first gathering them into its pinned staging buffer. Against the default
(ordinary arrays) this shows what that host copy costs an in-process caller. Other engines read the arrays as they
read any others.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from kiln.bench.data import Request
from kiln.engines import host_memory

ALIGN = 64  # each tensor starts on a cache line, as in the workers' arenas


@contextmanager
def shared_inputs(requests: list[Request]) -> Iterator[list[Request]]:
    """``requests`` with every fixed-size tensor copied into one listed shared buffer (read-only views on it);
    BYTES and empty tensors stay as they are. The buffer is unlisted on exit, once engines have let go of it."""
    arrays = [array for request in requests for array in request.values() if _placed(array)]
    size = sum(_aligned(array.nbytes) for array in arrays)
    mapping = mmap.mmap(-1, max(size, 1))
    shared = host_memory.share(memoryview(mapping))
    try:
        placed: list[Request] = []
        offset = 0
        for request in requests:
            moved: Request = {}
            for name, array in request.items():
                if not _placed(array):
                    moved[name] = array
                    continue
                view = np.frombuffer(mapping, dtype=array.dtype, count=array.size, offset=offset).reshape(array.shape)
                view[...] = array
                view.flags.writeable = False
                moved[name] = view
                offset += _aligned(array.nbytes)
            placed.append(moved)
        yield placed
    finally:
        shared.close()  # the mapping itself goes with the last view of it


def _placed(array: np.ndarray) -> bool:
    return array.dtype != object and array.nbytes > 0


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN
