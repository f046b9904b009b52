"""Arenas for tests of the frontends' handoff: two mappings of one arena file, as a worker and the server process
hold it, and a wait for every slot to come back."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Sequence

from kiln.frontends.handoff.arena import Arena, create_arena_file


def arena_pair(size: int = 1 << 16) -> tuple[Arena, Arena]:
    """Two mappings of one new arena of ``size`` bytes: the writer's and the reader's."""
    fd = create_arena_file(size)
    assert fd is not None, "arenas need memfd_create (Linux)"
    try:
        return Arena.from_fd(fd), Arena.from_fd(fd)
    finally:
        os.close(fd)


async def all_freed(arenas: Sequence[Arena], seconds: float = 5.0) -> bool:
    """Whether every slot of ``arenas`` is free within ``seconds``: an input slot comes back once the last numpy
    view of it is gone, so garbage is collected while waiting."""
    for _ in range(int(seconds / 0.005)):
        gc.collect()  # the views' weak references fire once the last view is gone
        if all(arena.used_bytes == 0 for arena in arenas):
            return True
        await asyncio.sleep(0.005)
    return False
