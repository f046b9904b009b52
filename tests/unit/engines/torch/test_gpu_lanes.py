"""Lanes on a CUDA device: several threads replay one engine's graphs at once, each on its own stream with its own
graphs and pinned staging buffers, and a dynamic batch's requests are staged row by row. Skipped without a GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kiln.engines.torch import TorchEngine
from kiln.errors import InternalError
from kiln.server.server import Server, ServerOptions
from kiln.tensor import DataType
from kiln.v2.types import InferRequest, InputTensor

from ._models import config, write_model_folder
from .test_gpu import GPU_PARAMETERS, IMAGE_IO, calls_from_threads, fp32_reference, images, load_gpu, served_logits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; PyTorch sees none")]


def test_threads_run_on_their_own_lanes_up_to_cuda_streams(tmp_path: Path, files: dict[str, Path]) -> None:
    engine = load_gpu(tmp_path, files["conv_export"], {**GPU_PARAMETERS, "cuda_streams": "3"})
    assert calls_from_threads(engine, [images(1 + i % 4) for i in range(8)], rounds=30) == []
    assert 1 < engine.cuda_streams_in_use <= 3  # 8 threads, at most 3 lanes
    engine.close()


def test_staged_parts_match_the_concatenated_batch(tmp_path: Path, files: dict[str, Path]) -> None:
    engine = load_gpu(tmp_path, files["conv_export"], GPU_PARAMETERS)
    parts = [images(1), images(3), images(2)]
    staged = engine.execute_parts([{"image": p} for p in parts], ["logits"])["logits"]
    assert staged.shape == (6, 5) and staged.dtype == np.float32
    np.testing.assert_allclose(staged, fp32_reference(np.concatenate(parts)), rtol=2e-2, atol=2e-2)
    again = engine.execute_parts([{"image": p} for p in parts[:2]], ["logits"])["logits"]  # the buffer is reused
    np.testing.assert_allclose(again, fp32_reference(np.concatenate(parts[:2])), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(staged, fp32_reference(np.concatenate(parts)), rtol=2e-2, atol=2e-2)  # still intact
    engine.close()


def test_a_cuda_tensor_input_is_copied_on_the_lanes_stream(tmp_path: Path, files: dict[str, Path]) -> None:
    engine = load_gpu(tmp_path, files["conv_export"], GPU_PARAMETERS)
    image = images(4)
    logits = engine.infer({"image": torch.from_numpy(image).cuda()})["logits"]
    got = logits.cpu().numpy() if isinstance(logits, torch.Tensor) else logits  # device inputs may give device outputs
    np.testing.assert_allclose(got, fp32_reference(image), rtol=2e-2, atol=2e-2)
    engine.close()


def test_parts_with_cuda_tensors_join_on_the_device(tmp_path: Path, files: dict[str, Path]) -> None:
    """A dynamic batch mixing inputs read in place from CUDA shared memory (tensors) with host arrays."""
    engine = load_gpu(tmp_path, files["conv_export"], GPU_PARAMETERS)
    parts = [images(2), images(1), images(3)]
    feeds = [{"image": torch.from_numpy(parts[0]).cuda()}, {"image": parts[1]},
             {"image": torch.from_numpy(parts[2]).cuda()}]
    logits = engine.execute_parts(feeds, ["logits"])["logits"]
    got = logits.cpu().numpy() if isinstance(logits, torch.Tensor) else logits
    assert got.shape == (6, 5)
    np.testing.assert_allclose(got, fp32_reference(np.concatenate(parts)), rtol=2e-2, atol=2e-2)
    engine.close()


def test_served_with_dynamic_batching_and_two_instances(tmp_path: Path, files: dict[str, Path]) -> None:
    text = config("torch_aoti", *IMAGE_IO, kind="KIND_GPU", parameters=GPU_PARAMETERS,
                  extra="dynamic_batching { max_queue_delay_microseconds: 2000 }")
    text = text.replace("count: 1", "count: 2")
    write_model_folder(tmp_path / "repo", "m", text, files["conv_export"])
    server = Server(ServerOptions(repositories=[tmp_path / "repo"]))
    assert not server.start()
    inputs = [images(1) for _ in range(16)]
    try:
        got = served_logits(server, inputs)
    finally:
        server.close()
    for image, logits in zip(inputs, got, strict=True):
        np.testing.assert_allclose(logits, fp32_reference(image), rtol=2e-2, atol=2e-2)


def test_a_launched_batch_holds_its_lane_until_collected(tmp_path: Path, files: dict[str, Path]) -> None:
    engine = load_gpu(tmp_path, files["conv_export"], {**GPU_PARAMETERS, "cuda_streams": "2"})
    assert engine.launches
    first, second = [images(2), images(1)], [images(3)]
    launched = [engine.launch_parts([{"image": p} for p in parts], ["logits"]) for parts in (first, second)]
    assert all(batch is not None for batch in launched)
    assert engine.launch_parts([{"image": images(1)}], ["logits"]) is None  # both lanes are busy
    outputs = []
    for batch in launched:
        assert batch is not None
        batch.wait()
        outputs.append(batch.collect()["logits"])
    np.testing.assert_allclose(outputs[0], fp32_reference(np.concatenate(first)), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(outputs[1], fp32_reference(second[0]), rtol=2e-2, atol=2e-2)
    with pytest.raises(InternalError, match="already collected"):
        launched[0].collect()
    again = engine.launch_parts([{"image": images(1)}], ["logits"])  # the lanes are free again
    assert again is not None and again.collect()["logits"].shape == (1, 5)  # collect waits for the device
    engine.close()


def test_served_batches_are_launched_from_the_event_loop(tmp_path: Path, files: dict[str, Path],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio
    import threading

    launching_threads: set[str] = set()
    launch = TorchEngine.launch_parts

    def recording(self: TorchEngine, *args: Any) -> Any:
        launching_threads.add(threading.current_thread().name)
        return launch(self, *args)

    monkeypatch.setattr(TorchEngine, "launch_parts", recording)
    text = config("torch_aoti", *IMAGE_IO, kind="KIND_GPU", parameters={**GPU_PARAMETERS, "cuda_streams": "2"},
                  extra="dynamic_batching { preferred_batch_size: [ 4 ] }").replace("count: 1", "count: 2")
    write_model_folder(tmp_path / "repo", "m", text, files["conv_export"])
    server = Server(ServerOptions(repositories=[tmp_path / "repo"]))
    assert not server.start()
    inputs = [images(1) for _ in range(24)]

    async def send_all() -> tuple[str, list[np.ndarray]]:
        requests = [InferRequest(model_name="m", inputs=[InputTensor("image", DataType.FP32, i.shape, i)])
                    for i in inputs]
        responses = await asyncio.gather(*(server.infer(r) for r in requests))
        return threading.current_thread().name, [r.outputs[0].data for r in responses]

    try:
        loop_thread, got = asyncio.run(send_all())
        stats = server.model_statistics("m")[0]
    finally:
        server.close()
    assert launching_threads == {loop_thread}
    assert stats.inference_count == 24 and stats.execution_count == 6  # preferred batches of 4
    for image, logits in zip(inputs, got, strict=True):
        np.testing.assert_allclose(logits, fp32_reference(image), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("batching", ["dynamic_batching { }", ""])
def test_spread_arrivals_keep_one_launched_lane_per_instance(tmp_path: Path, files: dict[str, Path],
                                                            batching: str) -> None:
    """Requests one loop turn apart (as from the network) wait for their instance's batch instead of taking
    further lanes, which would capture graphs on the event loop; without dynamic batching each runs alone."""
    import asyncio

    text = config("torch_aoti", *IMAGE_IO, kind="KIND_GPU", parameters={**GPU_PARAMETERS, "cuda_streams": "4"},
                  extra=batching).replace("count: 1", "count: 2")
    write_model_folder(tmp_path / "repo", "m", text, files["conv_export"])
    server = Server(ServerOptions(repositories=[tmp_path / "repo"]))
    assert not server.start()
    inputs = [images(1) for _ in range(8)]

    async def client(image: np.ndarray) -> list[np.ndarray]:
        answers = []
        for _ in range(10):
            request = InferRequest(model_name="m", inputs=[InputTensor("image", DataType.FP32, image.shape, image)])
            answers.append((await server.infer(request)).outputs[0].data)
            await asyncio.sleep(0)  # the next request comes a loop turn later
        return answers

    async def send_all() -> list[list[np.ndarray]]:
        tasks = []
        for image in inputs:
            tasks.append(asyncio.ensure_future(client(image)))
            await asyncio.sleep(0.0002)
        return list(await asyncio.gather(*tasks))

    try:
        got = asyncio.run(send_all())
        engines = [engine for version in server._models["m"].versions.values() if version.loaded is not None
                   for engine in version.loaded.engines]
        lanes = [getattr(engine, "cuda_streams_in_use", 0) for engine in engines]
        stats = server.model_statistics("m")[0]
    finally:
        server.close()
    assert len(engines) == 2 and lanes == [1, 1]
    assert stats.inference_count == 80
    if not batching:
        assert stats.execution_count == 80
    for image, answers in zip(inputs, got, strict=True):
        for logits in answers:
            np.testing.assert_allclose(logits, fp32_reference(image), rtol=2e-2, atol=2e-2)
