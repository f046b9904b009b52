"""The list of shared host buffers engines may read requests from in place: lookups by address, and closing, which
runs the engines' callbacks before the buffer leaves the list."""

from __future__ import annotations

import mmap

import numpy as np

from kiln.engines import host_memory


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def test_an_array_inside_a_shared_buffer_is_found_and_one_outside_is_not() -> None:
    memory = mmap.mmap(-1, 1 << 16)
    buffer = memoryview(memory)
    shared = host_memory.share(buffer)
    try:
        rows = np.frombuffer(buffer, dtype=np.float16, count=300, offset=4096)
        assert host_memory.containing(_address(rows), rows.nbytes) is shared
        assert shared.address == _address(np.frombuffer(buffer, dtype=np.uint8))
        assert shared.size == 1 << 16
        last = np.frombuffer(buffer, dtype=np.uint8, count=16, offset=(1 << 16) - 16)
        assert host_memory.containing(_address(last), 16) is shared
        assert host_memory.containing(_address(last), 17) is None  # runs past the end
        elsewhere = np.zeros(300, dtype=np.float16)
        assert host_memory.containing(_address(elsewhere), elsewhere.nbytes) is None
    finally:
        shared.close()
    assert host_memory.containing(_address(rows), rows.nbytes) is None
    del rows, last
    buffer.release()
    memory.close()


def test_two_buffers_are_told_apart() -> None:
    first, second = mmap.mmap(-1, 8192), mmap.mmap(-1, 8192)
    views = memoryview(first), memoryview(second)
    handles = [host_memory.share(view) for view in views]
    try:
        for view, handle in zip(views, handles, strict=True):
            inside = np.frombuffer(view, dtype=np.uint8, count=100, offset=1000)
            assert host_memory.containing(_address(inside), 100) is handle
    finally:
        for handle in handles:
            handle.close()


def test_closing_runs_the_callbacks_first_and_once() -> None:
    memory = mmap.mmap(-1, 4096)
    shared = host_memory.share(memoryview(memory))
    seen: list[bool] = []
    shared.on_close(lambda s: seen.append(host_memory.containing(s.address, 1) is s))
    shared.close()
    shared.close()
    assert seen == [False]  # once, and the buffer was already off the list (no engine finds it meanwhile)
    late: list[object] = []
    shared.on_close(late.append)  # a callback that comes after the close runs at once
    assert late == [shared]
