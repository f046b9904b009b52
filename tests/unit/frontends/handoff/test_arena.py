"""The arena's allocator: slots reused after free, neighbours merged, no slot when none fits, and the bytes one
side writes seen by another mapping of the same file."""

from __future__ import annotations

import os

import pytest

from kiln.frontends.handoff.arena import ALIGN, Arena, create_arena_file

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="arenas need memfd_create (Linux)")


@pytest.fixture
def fd() -> int:
    made = create_arena_file(4096)
    assert made is not None
    return made


def test_a_freed_slot_is_reused(fd: int) -> None:
    arena = Arena.from_fd(fd)
    first = arena.allocate(100)
    second = arena.allocate(100)
    assert (first, second) == (0, 2 * ALIGN)  # 100 bytes take two aligned blocks
    arena.free(first)  # type: ignore[arg-type]
    assert arena.allocate(64) == 0
    assert arena.used_bytes == 2 * ALIGN + ALIGN


def test_neighbours_merge_so_a_large_slot_fits_again(fd: int) -> None:
    arena = Arena.from_fd(fd)
    slots = [arena.allocate(1024) for _ in range(4)]
    assert None not in slots
    assert arena.allocate(1) is None  # full
    for slot in (slots[1], slots[3], slots[2], slots[0]):  # freed out of order
        arena.free(slot)  # type: ignore[arg-type]
    assert arena.used_bytes == 0
    assert arena.allocate(4096) == 0


def test_a_request_larger_than_the_room_left_gets_none(fd: int) -> None:
    arena = Arena.from_fd(fd)
    assert arena.allocate(4097) is None
    assert arena.allocate(4000) == 0
    assert arena.allocate(200) is None


def test_freeing_an_unknown_offset_changes_nothing(fd: int) -> None:
    arena = Arena.from_fd(fd)
    slot = arena.allocate(64)
    arena.free(12345)
    arena.free(32)
    assert arena.used_bytes == ALIGN
    arena.free(slot)  # type: ignore[arg-type]
    arena.free(slot)  # type: ignore[arg-type]  # twice: ignored
    assert arena.allocate(4096) == 0


def test_another_mapping_sees_the_bytes_written(fd: int) -> None:
    writer = Arena.from_fd(fd)
    reader = Arena.from_fd(fd)
    slot = writer.allocate(5)
    assert slot is not None
    writer.write(slot, b"hello")
    view = reader.view(slot, 5)
    assert bytes(view) == b"hello" and view.readonly
    with pytest.raises(ValueError, match="outside the arena"):
        reader.view(4090, 10)
