"""Unloading releases the engine: RSS stays flat over repeated load/unload cycles."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import psutil

from kiln.demo import build_demo_repository
from kiln.server import InferRequest, InputTensor, Server, ServerOptions
from kiln.tensor import DataType

CYCLES = 50


def cycle(server: Server) -> None:
    server.load_model("mlp")
    x = np.ones((4, 64), np.float32)
    server.infer_sync(InferRequest("mlp", [InputTensor("INPUT0", DataType.FP32, x.shape, x)]))
    server.unload_model("mlp")
    assert server.wait_unloaded(30)


def test_rss_grows_less_than_ten_percent_over_fifty_load_unload_cycles(tmp_path: Path) -> None:
    build_demo_repository(tmp_path)
    server = Server(ServerOptions(repositories=[tmp_path], control_mode="explicit"))
    server.start()
    process = psutil.Process()
    for _ in range(5):  # allocator and onnxruntime warm-up
        cycle(server)
    gc.collect()
    baseline = process.memory_info().rss
    for _ in range(CYCLES):
        cycle(server)
    gc.collect()
    grown = process.memory_info().rss - baseline
    server.close()
    assert grown < 0.10 * baseline, f"RSS grew by {grown / 2**20:.1f} MiB from {baseline / 2**20:.1f} MiB"
    record = server._models["mlp"]
    assert record.versions == {}  # nothing keeps the unloaded engines alive


def test_an_unloaded_engine_is_garbage(tmp_path: Path) -> None:
    import weakref

    build_demo_repository(tmp_path)
    server = Server(ServerOptions(repositories=[tmp_path], control_mode="explicit", load_models=("mlp",)))
    server.start()
    loaded = server._models["mlp"].versions[1].loaded
    assert loaded is not None
    refs = [weakref.ref(engine) for engine in loaded.engines] + [weakref.ref(loaded)]
    del loaded
    server.unload_model("mlp")
    assert server.wait_unloaded(30)
    gc.collect()
    assert all(ref() is None for ref in refs)
    server.close()
