"""Keep freed heap memory in kiln's serving processes (`kiln serve`'s server process and workers, the cluster's
replicas) instead of giving it back to the kernel after every request.

glibc hands the free memory at the top of its heap back to the kernel once it exceeds the trim threshold, which it
sets to twice the largest block it has seen freed from an mmap (a few hundred KB where requests carry images). A
worker that receives a 301 KB body and copies its tensor bytes once frees about that much at the top of the heap
after every request, so the heap shrinks and the next request faults the same pages in again: 100-260 minor faults
per request, 200-300 us of a worker's CPU, 0.3-0.5 ms of latency at concurrency 1 (benchmarks/README.md). Whether
it happens depends on what else lies in the heap, so it comes and goes between runs of the same server.

:func:`keep_freed_heap` fixes both thresholds at the ceilings glibc's own adjustment would reach (blocks up to
32 MB come from the heap, up to 64 MB of free heap stays mapped), as if the process had already seen a 32 MB block
freed. Settings the user gave glibc (``GLIBC_TUNABLES`` or the ``MALLOC_*_`` variables) are left alone.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's ceiling for its adaptive mmap threshold on 64-bit systems
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES  # the ratio glibc's adaptive rule keeps
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def user_tuned_malloc(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether the environment carries malloc settings of the user's own."""
    return any(name in environ for name in _USER_SETTINGS) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")


def keep_freed_heap() -> bool:
    """Set the thresholds (see the module's docstring); True where glibc took them. A no-op off Linux, on a C
    library without ``mallopt`` and where the user tuned malloc."""
    if not sys.platform.startswith("linux") or user_tuned_malloc():
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the C library this process already runs on
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                                 TRIM_THRESHOLD_BYTES))
