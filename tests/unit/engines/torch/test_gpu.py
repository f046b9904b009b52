"""The PyTorch engine on a CUDA device: fp16, channels_last and one CUDA graph per batch size, on TorchScript,
exported programs and an AOTInductor package. Tiny models; run where a GPU is (skipped elsewhere)."""

from __future__ import annotations

import asyncio
import gc
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import kiln
from kiln.engines.torch import TorchEngine
from kiln.errors import ConfigError
from kiln.server.server import Server
from kiln.tensor import DataType
from kiln.v2.types import InferRequest, InputTensor

from ._models import ConvNet, config, require_loadable_aoti, write_model_folder

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; PyTorch sees none")]

RNG = np.random.default_rng(11)
IMAGE_IO = ([("image", "TYPE_FP32", [3, 8, 8])], [("logits", "TYPE_FP32", [5])])
GPU_PARAMETERS = {"precision": "fp16", "channels_last": "true", "cuda_graphs": "true", "cuda_graph_batch_sizes": "1,4"}


def images(rows: int) -> np.ndarray:
    return RNG.standard_normal((rows, 3, 8, 8)).astype(np.float32)


def fp32_reference(image: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return ConvNet().eval()(torch.from_numpy(image)).numpy()


def served_logits(server: Server, inputs: list[np.ndarray], model: str = "m") -> list[np.ndarray]:
    """Every image sent at once to ``server`` from one event loop; each one's logits."""

    async def send_all() -> list[np.ndarray]:
        requests = [InferRequest(model_name=model, inputs=[InputTensor("image", DataType.FP32, i.shape, i)])
                    for i in inputs]
        responses = await asyncio.gather(*(server.infer(r) for r in requests))
        return [r.outputs[0].data for r in responses]

    return asyncio.run(send_all())


def load_gpu(tmp_path: Path, source: Path, parameters: dict[str, str], name: str = "m") -> TorchEngine:
    platform = "pytorch_libtorch" if source.suffix == ".pt" else "torch_aoti"
    text = config(platform, *IMAGE_IO, kind="KIND_GPU", parameters=parameters)
    engine = kiln.load(write_model_folder(tmp_path, name, text, source), kind="gpu")
    assert isinstance(engine, TorchEngine)
    return engine


@pytest.fixture(scope="module")
def aoti_fp16_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ConvNet compiled ahead of time for CUDA in fp16, with a dynamic batch dimension."""
    with warnings.catch_warnings():
        # Inductor imports torch.utils.mkldnn, whose TorchScript classes warn that `torch.jit.script_method` is
        # deprecated; packaging pickles a pytree spec through a deprecated isinstance check. Neither is ours.
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated",
                                category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        module = ConvNet().eval().cuda().half()
        example = (torch.zeros(2, 3, 8, 8, device="cuda", dtype=torch.float16),)
        batch = torch.export.Dim("batch", min=1, max=16)
        program = torch.export.export(module, example, dynamic_shapes={"image": {0: batch}})
        path = tmp_path_factory.mktemp("aoti_cuda") / "model.pt2"
        torch._inductor.aoti_compile_and_package(program, package_path=str(path))
    require_loadable_aoti(path)
    return path


@pytest.mark.parametrize("kind", ["conv_script", "conv_export"])
def test_fp16_channels_last_and_a_cuda_graph_per_batch_size(tmp_path: Path, files: dict[str, Path],
                                                           kind: str) -> None:
    engine = load_gpu(tmp_path, files[kind], GPU_PARAMETERS)
    assert engine.device == torch.device("cuda", 0) and engine.thread_safe
    assert engine.cuda_graph_batch_sizes == (1, 4)  # the listed sizes are captured at load
    assert engine.cuda_graph_capture_order == (4, 1)  # largest first, so smaller graphs reuse its memory
    for rows in (4, 1, 3, 4, 3):  # replays must see each call's data, not the capture's
        image = images(rows)
        logits = engine.infer({"image": image})["logits"]
        assert logits.dtype == np.float32 and logits.shape == (rows, 5)
        np.testing.assert_allclose(logits, fp32_reference(image), rtol=2e-2, atol=2e-2)
    assert engine.cuda_graph_batch_sizes == (1, 3, 4)  # 3 was captured on first use
    engine.close()


def test_concurrent_callers_share_the_graphs_safely(tmp_path: Path, files: dict[str, Path]) -> None:
    engine = load_gpu(tmp_path, files["conv_export"], GPU_PARAMETERS)
    assert calls_from_threads(engine, [images(4) for _ in range(8)], rounds=20) == []
    engine.close()


def test_a_compiled_module_under_cuda_graphs_and_lanes(tmp_path: Path, files: dict[str, Path]) -> None:
    """torch.compile (one graph with a dynamic batch dimension, and batch 1's) compiled at load, captured in every
    lane's CUDA graphs: threads on several lanes, and a batch size first seen after load, compile nothing more."""
    from kiln.engines.torch.compile_cache import compile_counts

    engine = load_gpu(tmp_path, files["conv_export"], {**GPU_PARAMETERS, "compile_mode": "default"})
    assert engine.thread_safe and engine.compile_counts is not None
    assert engine.compile_counts.hits + engine.compile_counts.misses == 2
    assert engine.cuda_graph_batch_sizes == (1, 4)
    before = compile_counts()
    assert calls_from_threads(engine, [images(3) for _ in range(4)], rounds=10) == []
    assert engine.cuda_streams_in_use > 1 and 3 in engine.cuda_graph_batch_sizes
    after = compile_counts().since(before)
    assert (after.hits, after.misses) == (0, 0)
    engine.close()


def calls_from_threads(engine: TorchEngine, inputs: list[np.ndarray], rounds: int) -> list[str]:
    """Each input from its own thread, ``rounds`` times, all threads starting together; the threads that got
    another call's result."""
    expected = [fp32_reference(image) for image in inputs]
    start = threading.Barrier(len(inputs))
    failures: list[str] = []

    def worker(index: int) -> None:
        start.wait()
        for _ in range(rounds):
            got = engine.infer({"image": inputs[index]})["logits"]
            if not np.allclose(got, expected[index], rtol=2e-2, atol=2e-2):
                failures.append(f"thread {index} got another call's result")
                return

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return failures


def test_plain_gpu_module_without_graphs(tmp_path: Path, files: dict[str, Path]) -> None:
    engine = load_gpu(tmp_path, files["conv_script"], {"precision": "bf16"})
    image = images(5)
    np.testing.assert_allclose(engine.infer({"image": image})["logits"], fp32_reference(image), rtol=5e-2, atol=5e-2)
    assert engine.cuda_graph_batch_sizes == ()
    engine.close()


def test_aoti_package_on_cuda_with_fp16_inputs_and_graphs(tmp_path: Path, aoti_fp16_package: Path) -> None:
    engine = load_gpu(tmp_path, aoti_fp16_package,
                      {"precision": "fp16", "cuda_graphs": "true", "cuda_graph_batch_sizes": "2"})
    assert engine.format.value == "aoti" and engine.cuda_graph_batch_sizes == (2,)
    for rows in (2, 5):
        image = images(rows)
        logits = engine.infer({"image": image})["logits"]
        assert logits.dtype == np.float32
        np.testing.assert_allclose(logits, fp32_reference(image), rtol=2e-2, atol=2e-2)
    assert engine.cuda_graph_batch_sizes == (2, 5)
    engine.close()


def test_a_cuda_package_refuses_a_cpu_instance(tmp_path: Path, aoti_fp16_package: Path) -> None:
    text = config("torch_aoti", *IMAGE_IO, parameters={"precision": "bf16"})
    with pytest.raises(ConfigError) as info:
        kiln.load(write_model_folder(tmp_path, "m", text, aoti_fp16_package))
    assert str(info.value) == ("model 'm': the AOTInductor package was compiled for 'cuda', but this instance runs on "
                               "'cpu'; compile a package for that device or change the instance group's kind")


def test_close_gives_the_memory_back(tmp_path: Path, files: dict[str, Path]) -> None:
    # A first engine sets up what lives as long as the process: the shared capture stream and its cuBLAS workspace.
    load_gpu(tmp_path, files["conv_export"], GPU_PARAMETERS, name="first").close()
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    engine = load_gpu(tmp_path, files["conv_export"], GPU_PARAMETERS)
    engine.infer({"image": images(2)})
    assert torch.cuda.memory_allocated() > before
    engine.close()
    del engine
    gc.collect()
    assert torch.cuda.memory_allocated() <= before
