"""Host memory that another process writes requests into, which an engine may read in place.

`kiln serve`'s frontend worker processes write each request's tensors into a shared-memory arena the server
process maps (kiln/frontends/handoff/arena.py); the request's inputs are numpy views on it. A CUDA engine that knows
an input lies in such a buffer can copy it to the device straight from there, once the buffer is page-locked,
instead of first copying it into its own pinned staging buffer (kiln/engines/torch/pinned_host.py). This module only
keeps the list of shared buffers, so the side that maps them needs no engine and the engine no frontend.

A buffer stays listed until its handle is closed. Closing calls the engines' ``on_close`` callbacks first, so an
engine lets go of the memory (unpins it) before its owner unmaps it.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable

import numpy as np


class SharedHost:
    """One shared buffer: ``address`` and ``size`` of its memory, ``buffer`` writable over all of it."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.size = buffer.nbytes
        self.address = int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data) if self.size else 0
        self._on_close: list[Callable[[SharedHost], None]] = []
        self.closed = False

    def on_close(self, callback: Callable[[SharedHost], None]) -> None:
        """Call ``callback`` before the buffer is unlisted (at once when it already is)."""
        with _lock:
            if not self.closed:
                self._on_close.append(callback)
                return
        callback(self)

    def close(self) -> None:
        """Unlist the buffer, after every ``on_close`` callback has run. Closing twice does nothing."""
        with _lock:
            if self.closed:
                return
            self.closed = True
            callbacks, self._on_close = self._on_close, []
            index = bisect.bisect_left(_starts, self.address)
            while index < len(_starts) and _starts[index] == self.address:
                if _listed[index] is self:
                    del _starts[index], _listed[index]
                    break
                index += 1
        for callback in callbacks:
            callback(self)


_lock = threading.Lock()
_starts: list[int] = []  # sorted start addresses of the listed buffers, parallel to _listed
_listed: list[SharedHost] = []


def share(buffer: memoryview) -> SharedHost:
    """List ``buffer`` (writable, contiguous) as memory requests may lie in; close the handle before unmapping it."""
    shared = SharedHost(buffer)
    with _lock:
        index = bisect.bisect_right(_starts, shared.address)
        _starts.insert(index, shared.address)
        _listed.insert(index, shared)
    return shared


def containing(address: int, nbytes: int) -> SharedHost | None:
    """The listed buffer holding all of ``address .. address + nbytes``, or None."""
    with _lock:
        index = bisect.bisect_right(_starts, address) - 1
        if index < 0:
            return None
        shared = _listed[index]
    return shared if address + nbytes <= shared.address + shared.size else None
