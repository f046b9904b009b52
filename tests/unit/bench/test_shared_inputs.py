"""--input-memory shared: request tensors moved into a buffer listed for GPU engines, and unlisted after."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.bench.shared_inputs import ALIGN, shared_inputs
from kiln.engines import host_memory


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def test_tensors_move_into_one_listed_buffer_and_leave_it_listed_only_while_used() -> None:
    image = np.arange(3 * 5 * 7, dtype=np.float16).reshape(1, 3, 5, 7)
    mask = np.array([[1, 0, 1]], dtype=np.int64)
    words = np.array([b"kiln", b"serve"], dtype=object)
    empty = np.zeros((0, 4), dtype=np.float32)
    requests = [{"image": image, "mask": mask, "words": words, "empty": empty}, {"image": image * 2}]
    with shared_inputs(requests) as placed:
        assert len(placed) == 2
        first, second = placed
        for name in ("image", "mask"):
            np.testing.assert_array_equal(first[name], requests[0][name])
            assert first[name].dtype == requests[0][name].dtype and first[name].shape == requests[0][name].shape
            assert not first[name].flags.writeable  # shared by every slot that sends it
            assert _address(first[name]) % ALIGN == 0
        np.testing.assert_array_equal(second["image"], image * 2)
        listed = {host_memory.containing(_address(a), a.nbytes) for a in (first["image"], first["mask"],
                                                                         second["image"])}
        assert len(listed) == 1 and None not in listed  # one buffer holds them all
        assert first["words"] is words and first["empty"] is empty  # BYTES and empty tensors stay as they are
        kept = first["image"]
    assert host_memory.containing(_address(kept), kept.nbytes) is None
    np.testing.assert_array_equal(kept, image)  # the views stay readable: the mapping lives as long as they do


def test_the_buffer_is_unlisted_when_the_run_fails() -> None:
    image = np.ones((1, 8), dtype=np.float32)
    with pytest.raises(RuntimeError, match="measured nothing"), shared_inputs([{"x": image}]) as placed:
        kept = placed[0]["x"]
        raise RuntimeError("measured nothing")
    assert host_memory.containing(_address(kept), kept.nbytes) is None
