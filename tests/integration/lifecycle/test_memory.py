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


def test_publishing_version_after_version_does_not_grow_the_heap(tmp_path: Path) -> None:
    """A model with a new version every few seconds for weeks: each retired version must leave nothing behind
    (its drain thread, its routing counts and latencies, an ever longer list of unloaded versions)."""
    import shutil
    import tracemalloc

    build_demo_repository(tmp_path)
    folder = tmp_path / "mlp"
    with (folder / "config.pbtxt").open("a") as config:
        config.write("version_policy { latest { num_versions: 2 } }\n")
    x = np.ones((1, 64), np.float32)
    server = Server(ServerOptions(repositories=[tmp_path], control_mode="explicit", load_models=("mlp",)))
    server.start()

    def publish(versions: range) -> None:
        for version in versions:
            shutil.copytree(folder / str(version - 1), folder / str(version))
            server.load_model("mlp")
            for named in ("", str(version - 1)):
                server.infer_sync(InferRequest("mlp", [InputTensor("INPUT0", DataType.FP32, x.shape, x)],
                                               model_version=named))
            shutil.rmtree(folder / str(version - 2), ignore_errors=True)
        assert server.wait_unloaded(30)

    try:
        publish(range(2, 40))  # past the number of unloaded versions remembered
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        publish(range(40, 160))
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        server.close()
    assert grown < 160 * 1024, f"the Python heap grew by {grown / 1024:.0f} KiB over 120 published versions"
