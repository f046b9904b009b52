"""How many connections each HTTP worker holds, in memory every worker maps, so that new connections go to the
workers holding the fewest.

The workers accept from one listening socket. Left to the kernel, new connections are not spread by load: with a
socket per worker (``SO_REUSEPORT``) each connection is hashed to one at random, and perf_analyzer's 16 connections
gave one of 4 workers 1.7 times its share of the work while another idled
(benchmarks/results/served_core_profile-h100-2026-12-06.md); from one shared socket, the first worker to wake takes
a whole burst. So each worker writes its count of open connections into its slot here, and accepts only while no
live worker holds fewer (listener.py).

A slot is one 64-bit integer that only its worker writes; the others only read it, so no lock is needed (a count
read while it changes is off by one connection at most). The server process marks a slot ``ABSENT`` before it starts
the slot's worker, so a dead worker's last count does not hold the others back.
"""

from __future__ import annotations

import mmap
import os

ABSENT = -1
_SLOT = 8  # bytes


class ConnectionShares:
    """The workers' connection counts over ``buffer`` (one slot per worker); ``index`` is this process's slot, or
    None in the server process, which only marks slots absent."""

    def __init__(self, buffer: mmap.mmap, index: int | None = None) -> None:
        self._buffer = buffer
        self._counts = memoryview(buffer).cast("q")
        self.index = index

    @classmethod
    def create(cls, workers: int) -> tuple[ConnectionShares, int] | None:
        """Shares for ``workers`` workers, every slot absent, with the descriptor a worker inherits to map them;
        None where anonymous memory files are not available (then workers accept as the kernel wakes them)."""
        if not hasattr(os, "memfd_create"):
            return None
        fd = os.memfd_create("kiln-http-connection-shares", 0)
        os.ftruncate(fd, workers * _SLOT)
        shares = cls(mmap.mmap(fd, workers * _SLOT))
        for slot in range(workers):
            shares.mark_absent(slot)
        return shares, fd

    @classmethod
    def inherited(cls, fd: int, index: int) -> ConnectionShares:
        """A worker's view of the shares it inherited as ``fd``; the descriptor is closed once mapped."""
        try:
            return cls(mmap.mmap(fd, os.fstat(fd).st_size), index)
        finally:
            os.close(fd)

    def mark_absent(self, slot: int) -> None:
        self._counts[slot] = ABSENT

    def publish(self, count: int) -> None:
        """This worker holds ``count`` connections."""
        assert self.index is not None, "only a worker publishes"
        self._counts[self.index] = count

    def withdraw(self) -> None:
        """This worker accepts no more connections (it is draining)."""
        assert self.index is not None, "only a worker withdraws"
        self.mark_absent(self.index)

    def fewest(self) -> int:
        """The fewest connections any live worker holds (this one's published count included)."""
        live = [count for count in self._counts if count != ABSENT]
        return min(live) if live else 0

    def counts(self) -> list[int]:
        return list(self._counts)

    def close(self) -> None:
        self._counts.release()
        self._buffer.close()
