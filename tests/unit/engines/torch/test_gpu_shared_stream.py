"""Large batches replay on one CUDA stream shared by a model's instances (``cuda_shared_stream_from_batch``); smaller
ones on their lane's own stream. Skipped without a GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.server.server import Server, ServerOptions

from ._models import config, write_model_folder
from .test_gpu import GPU_PARAMETERS, IMAGE_IO, fp32_reference, images, load_gpu, served_logits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; PyTorch sees none")]

SHARED_FROM_4 = {**GPU_PARAMETERS, "cuda_streams": "2", "cuda_shared_stream_from_batch": "4"}
SLEEP_CYCLES = 1_000_000_000  # about half a second of GPU clock: far longer than a tiny model's batch


def test_instances_of_one_model_share_the_stream(tmp_path: Path, files: dict[str, Path]) -> None:
    first = load_gpu(tmp_path / "a", files["conv_export"], SHARED_FROM_4)
    second = load_gpu(tmp_path / "b", files["conv_export"], SHARED_FROM_4)
    other = load_gpu(tmp_path / "c", files["conv_export"], SHARED_FROM_4, name="other")
    off = load_gpu(tmp_path / "d", files["conv_export"], {**GPU_PARAMETERS, "cuda_shared_stream_from_batch": "off"})
    assert first.shared_compute_stream is not None
    assert first.shared_compute_stream is second.shared_compute_stream
    assert other.shared_compute_stream is not None and other.shared_compute_stream is not first.shared_compute_stream
    assert off.shared_compute_stream is None
    for engine in (first, second, other, off):
        engine.close()


def test_a_large_batch_waits_for_the_shared_stream_and_a_small_one_does_not(tmp_path: Path,
                                                                            files: dict[str, Path]) -> None:
    engine = load_gpu(tmp_path, files["conv_export"], SHARED_FROM_4)
    shared = engine.shared_compute_stream
    assert shared is not None
    large, small = images(4), images(1)
    for order in ((large, small), (small, large)):  # both lanes capture both sizes now, not while the GPU sleeps
        launched = [engine.launch_parts([{"image": rows}], ["logits"]) for rows in order]
        for batch in launched:
            assert batch is not None
            batch.collect()
    with torch.cuda.stream(shared):
        torch.cuda._sleep(SLEEP_CYCLES)  # busy the shared stream, as another instance's large batch would
    on_shared = engine.launch_parts([{"image": large}], ["logits"])
    on_lane = engine.launch_parts([{"image": small}], ["logits"])
    assert on_shared is not None and on_lane is not None
    on_lane.wait()
    assert not shared.query(), "the batch of 1 waited for the shared stream"
    on_shared.wait()
    assert shared.query(), "the batch of 4 finished before the shared stream's earlier work"
    np.testing.assert_allclose(on_shared.collect()["logits"], fp32_reference(large), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(on_lane.collect()["logits"], fp32_reference(small), rtol=2e-2, atol=2e-2)
    engine.close()


def test_served_large_batches_of_two_instances_are_right(tmp_path: Path, files: dict[str, Path]) -> None:
    text = config("torch_aoti", *IMAGE_IO, kind="KIND_GPU", parameters=SHARED_FROM_4,
                  extra="dynamic_batching { preferred_batch_size: [ 4 ] }").replace("count: 1", "count: 2")
    write_model_folder(tmp_path / "repo", "m", text, files["conv_export"])
    server = Server(ServerOptions(repositories=[tmp_path / "repo"]))
    assert not server.start()
    inputs = [images(1) for _ in range(64)]
    try:
        got = served_logits(server, inputs)
        stats = server.model_statistics("m")[0]
    finally:
        server.close()
    assert stats.inference_count == 64 and stats.execution_count == 16  # every batch of 4: all on the shared stream
    for image, logits in zip(inputs, got, strict=True):
        np.testing.assert_allclose(logits, fp32_reference(image), rtol=2e-2, atol=2e-2)
