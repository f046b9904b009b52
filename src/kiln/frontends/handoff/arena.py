"""A shared-memory arena: one anonymous memory file mapped by two processes, carved into variable-size slots.

The server process creates the arena (``memfd_create``: no name in /dev/shm to leak or to outgrow a container's
small /dev/shm) and passes its descriptor to the worker it starts. One side writes and owns the allocator; the
other side reads views and tells the writer, over the link, which slots it may reuse. Slots start on 64-byte
boundaries so that numpy views over them are aligned as numpy's own arrays are.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os

ALIGN = 64
ARENA_BYTES = 64 * 2**20
"""Each worker's request arena and response arena (HTTP and gRPC workers). Pages are taken as they are first
written, so this bounds the memory a worker's tensors in flight may use; a request or answer that finds no room
travels inline."""


def align(size: int) -> int:
    return (size + ALIGN - 1) // ALIGN * ALIGN


def create_arena_file(size: int) -> int | None:
    """A descriptor of a new anonymous shared file of ``size`` bytes, or None where the platform has none (the
    link then carries tensor bytes inline). Pages are only taken when written, so an idle arena costs nothing."""
    if not hasattr(os, "memfd_create"):
        return None
    fd = os.memfd_create("kiln-arena", 0)  # not inherited unless passed on purpose (pass_fds)
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        return None
    return fd


class Arena:
    """A mapping of an arena file. ``allocate``/``free`` are the writer's; ``view`` serves both sides."""

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.buffer = memoryview(self._map)
        self.readonly = self.buffer.toreadonly()
        # Free blocks as two sorted parallel lists (offsets, sizes); merged with their neighbours on free.
        self._offsets = [0]
        self._sizes = [size]
        self._used: dict[int, int] = {}

    @classmethod
    def from_fd(cls, fd: int) -> Arena:
        return cls(fd, os.fstat(fd).st_size)

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def allocate(self, size: int) -> int | None:
        """The offset of a free slot of at least ``size`` bytes (first fit), or None when none is left."""
        need = align(max(size, 1))
        for index, free in enumerate(self._sizes):
            if free >= need:
                offset = self._offsets[index]
                if free == need:
                    del self._offsets[index], self._sizes[index]
                else:
                    self._offsets[index] += need
                    self._sizes[index] -= need
                self._used[offset] = need
                return offset
        return None

    def free(self, offset: int) -> None:
        """Give a slot back; an offset that is not an allocated slot is ignored (a confused peer must not corrupt
        the free list)."""
        size = self._used.pop(offset, None)
        if size is None:
            return
        index = bisect.bisect(self._offsets, offset)
        if index < len(self._offsets) and offset + size == self._offsets[index]:  # merge with the next block
            size += self._sizes[index]
            del self._offsets[index], self._sizes[index]
        if index > 0 and self._offsets[index - 1] + self._sizes[index - 1] == offset:  # and with the previous
            self._sizes[index - 1] += size
        else:
            self._offsets.insert(index, offset)
            self._sizes.insert(index, size)

    def write(self, offset: int, data: bytes | memoryview) -> None:
        self.buffer[offset:offset + len(data)] = data

    def view(self, offset: int, size: int) -> memoryview:
        """Read-only bytes of a slot, as the in-process codecs' views over a request body are read-only."""
        if offset < 0 or offset + size > self.size:
            raise ValueError(f"arena range {offset}+{size} is outside the arena of {self.size} bytes")
        return self.readonly[offset:offset + size]

    def close(self) -> None:
        """Unmap when nothing views the arena any more; views still alive keep it mapped until they go."""
        # numpy views over it still alive keep the mapping: it goes with the last of them.
        with contextlib.suppress(BufferError):
            self.readonly.release()
            self.buffer.release()
            self._map.close()


def inherited_arena(fd: int) -> Arena | None:
    """A worker's arena from the descriptor its server process passed down (-1: none), the descriptor closed
    once mapped (the mapping stays)."""
    if fd < 0:
        return None
    arena = Arena.from_fd(fd)
    os.close(fd)
    return arena
