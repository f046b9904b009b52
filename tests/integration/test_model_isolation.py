"""Each model has its own queue and instances: a flood on one model does not starve another."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest

from kiln.config.spec import ModelSpec
from kiln.engines import Engine, EngineOptions, register_backend
from kiln.engines.base import Array
from kiln.server import InferRequest, InputTensor, Server, ServerOptions
from kiln.tensor import DataType

GATE = threading.Event()


class BlockedEngine(Engine):
    """Holds every batch until the test opens GATE."""

    def __init__(self, spec: ModelSpec, model_file: Path, options: EngineOptions) -> None:
        super().__init__(spec)

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        GATE.wait(30)
        return {outputs[0]: inputs["x"]}


CONFIG = """
backend: "{backend}" max_batch_size: 4
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 2 ] }} ]
output [ {{ name: "y" data_type: TYPE_FP32 dims: [ 2 ] }} ]
dynamic_batching {{ }}
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    register_backend("blocked_for_isolation_test", BlockedEngine)
    for name, backend in (("flooded", "blocked_for_isolation_test"), ("calm", "identity")):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.pbtxt").write_text(CONFIG.format(backend=backend))
    server = Server(ServerOptions(repositories=[tmp_path]))
    server.start()
    yield server
    GATE.set()
    server.close()


def request(model: str) -> InferRequest:
    data = np.ones((1, 2), np.float32)
    return InferRequest(model, [InputTensor("x", DataType.FP32, data.shape, data)])


async def test_flooded_model_does_not_delay_another(server: Server) -> None:
    GATE.clear()
    flood = [asyncio.ensure_future(server.infer(request("flooded"))) for _ in range(200)]
    await asyncio.sleep(0.05)
    assert server.pending("flooded", "1") == 200
    answers = await asyncio.wait_for(asyncio.gather(*(server.infer(request("calm")) for _ in range(20))), 5)
    assert all((a.outputs[0].data == 1).all() for a in answers)
    assert not any(f.done() for f in flood)
    GATE.set()
    await asyncio.wait_for(asyncio.gather(*flood), 30)


def test_thread_budget_is_shared_between_models(tmp_path: Path) -> None:
    from kiln.demo import build_demo_repository

    build_demo_repository(tmp_path)
    server = Server(ServerOptions(repositories=[tmp_path], cpu_threads=6))
    # simple and mlp share the budget; Python models and the ensemble have no thread pool to count
    server.start()
    try:
        for name in ("simple", "mlp"):
            record = server._models[name].versions[1]
            assert record.loaded is not None
            session = record.loaded.engines[0]._session  # type: ignore[attr-defined]
            assert session.get_session_options().intra_op_num_threads == 3
    finally:
        server.close()


class SlowLoadingEngine(Engine):
    """Records how many instances are being constructed at the same time."""

    lock = threading.Lock()
    loading = 0
    most = 0

    def __init__(self, spec: ModelSpec, model_file: Path, options: EngineOptions) -> None:
        super().__init__(spec)
        cls = SlowLoadingEngine
        with cls.lock:
            cls.loading += 1
            cls.most = max(cls.most, cls.loading)
        time.sleep(0.3)
        with cls.lock:
            cls.loading -= 1

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        return {outputs[0]: inputs["x"]}


def test_models_load_in_parallel(tmp_path: Path) -> None:
    register_backend("slow_loading_for_isolation_test", SlowLoadingEngine)
    for index in range(4):
        (tmp_path / f"m{index}" / "1").mkdir(parents=True)
        (tmp_path / f"m{index}" / "config.pbtxt").write_text(CONFIG.format(backend="slow_loading_for_isolation_test"))
    server = Server(ServerOptions(repositories=[tmp_path], model_load_thread_count=4))
    server.start()
    try:
        assert SlowLoadingEngine.most >= 2
        assert server.ready()
    finally:
        server.close()
