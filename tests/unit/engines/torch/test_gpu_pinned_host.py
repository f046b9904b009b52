"""Rows that lie in shared host memory (a frontend worker's arena, listed in kiln.engines.host_memory) are copied to
the device from where they lie, once the buffer is page-locked: the lane's staging buffer is never filled, the
results match, and closing the buffer unpins it. Rows elsewhere still go through staging. Skipped without a GPU."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.engines import host_memory
from kiln.engines.torch import TorchEngine, pinned_host
from kiln.engines.torch.pinned_host import host_rows, pinned_count

from .test_gpu import GPU_PARAMETERS, fp32_reference, images, load_gpu

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; PyTorch sees none")]


class _Arena:
    """A shared mapping, listed for engines, with requests' rows written back to back as a worker writes them."""

    def __init__(self, size: int = 1 << 20) -> None:
        self.memory = mmap.mmap(-1, size)
        self.buffer = memoryview(self.memory)
        self.shared = host_memory.share(self.buffer)
        self._next = 0

    def put(self, array: np.ndarray) -> np.ndarray:
        view = np.frombuffer(self.buffer, dtype=array.dtype, count=array.size, offset=self._next)
        self._next += (array.nbytes + 63) // 64 * 64
        view[...] = array.reshape(-1)
        view.flags.writeable = False  # as the server process sees a worker's arena
        return view.reshape(array.shape)


def _staged_rows(engine: TorchEngine) -> int:
    assert engine._lanes is not None
    return sum(lane.staging["image"].capacity for lane in engine._lanes.lanes)


def test_rows_in_a_shared_arena_skip_the_staging_buffer(tmp_path: Path, files: dict[str, Path]) -> None:
    engine = load_gpu(tmp_path, files["conv_export"], {**GPU_PARAMETERS, "cuda_streams": "2"})
    arena = _Arena()
    pinned_before = pinned_count()
    parts = [images(2), images(1), images(1)]
    launched = engine.launch_parts([{"image": arena.put(p)} for p in parts], ["logits"])
    assert launched is not None
    logits = launched.collect()["logits"]
    np.testing.assert_allclose(logits, fp32_reference(np.concatenate(parts)), rtol=2e-2, atol=2e-2)
    assert _staged_rows(engine) == 0
    assert pinned_count() == pinned_before + 1
    worker_path = engine.execute_parts([{"image": arena.put(parts[0])}], ["logits"])["logits"]
    np.testing.assert_allclose(worker_path, fp32_reference(parts[0]), rtol=2e-2, atol=2e-2)
    assert _staged_rows(engine) == 0
    arena.shared.close()
    assert pinned_count() == pinned_before
    engine.close()


def test_a_batch_with_rows_elsewhere_is_staged(tmp_path: Path, files: dict[str, Path]) -> None:
    engine = load_gpu(tmp_path, files["conv_export"], GPU_PARAMETERS)
    arena = _Arena()
    parts = [images(1), images(3)]
    logits = engine.execute_parts([{"image": arena.put(parts[0])}, {"image": parts[1]}], ["logits"])["logits"]
    np.testing.assert_allclose(logits, fp32_reference(np.concatenate(parts)), rtol=2e-2, atol=2e-2)
    assert _staged_rows(engine) >= 4
    arena.shared.close()
    engine.close()


def test_rows_back_to_back_make_one_copy() -> None:
    arena = _Arena()
    first, second = arena.put(images(2)), arena.put(images(1))
    arena.put(images(1))  # a request not in this batch leaves a gap
    fourth = arena.put(images(1))
    rows = host_rows([first, second, fourth], np.dtype(np.float32), torch.device("cuda"))
    assert rows is not None and rows.rows == 4 and len(rows.pieces) == 2
    assert rows.nbytes == 4 * images(1).nbytes
    assert host_rows([first, images(1)], np.dtype(np.float32), torch.device("cuda")) is None  # one part elsewhere
    assert host_rows([first.astype(np.float16)], np.dtype(np.float32), torch.device("cuda")) is None
    arena.shared.close()


def test_a_buffer_past_the_pinned_limit_is_staged(tmp_path: Path, files: dict[str, Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    engine = load_gpu(tmp_path, files["conv_export"], GPU_PARAMETERS)
    monkeypatch.setattr(pinned_host, "PINNED_LIMIT_BYTES", pinned_host._pinned_bytes + 4096)  # below one arena
    arena = _Arena()
    pinned_before = pinned_count()
    image = images(2)
    logits = engine.execute_parts([{"image": arena.put(image)}], ["logits"])["logits"]
    np.testing.assert_allclose(logits, fp32_reference(image), rtol=2e-2, atol=2e-2)
    assert _staged_rows(engine) >= 2 and pinned_count() == pinned_before
    arena.shared.close()
    engine.close()


def test_a_buffer_closed_before_its_first_batch_is_unpinned_at_once() -> None:
    """The close raced the batch's lookup: the unpin that follows must not wait for the lock the pin holds."""
    arena = _Arena()
    pinned_before = pinned_count()
    arena.shared.close()
    assert pinned_host._whole(arena.shared, torch.device("cuda")) is not None  # this batch still reads it
    assert pinned_count() == pinned_before


def _scattered(arena: _Arena, parts: list[np.ndarray]) -> list[np.ndarray]:
    """``parts`` in the arena with another request's rows between each two: one run of rows each."""
    placed = []
    for part in parts:
        placed.append(arena.put(part))
        arena.put(images(1))
    return placed


def test_rows_from_scattered_slots_are_copied_one_by_one(tmp_path: Path, files: dict[str, Path]) -> None:
    engine = load_gpu(tmp_path, files["conv_export"], GPU_PARAMETERS)
    arena = _Arena()
    parts = [images(1), images(2), images(1)]
    placed = _scattered(arena, parts)
    rows = host_rows(placed, np.dtype(np.float32), torch.device("cuda"))
    assert rows is not None and len(rows.pieces) == 3
    launched = engine.launch_parts([{"image": p} for p in placed], ["logits"])
    assert launched is not None
    np.testing.assert_allclose(launched.collect()["logits"], fp32_reference(np.concatenate(parts)),
                               rtol=2e-2, atol=2e-2)
    assert _staged_rows(engine) == 0
    arena.shared.close()
    engine.close()
