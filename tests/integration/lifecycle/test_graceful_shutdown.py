"""SIGTERM stops new work, lets in-flight requests finish, then the service returns 0."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from kiln.engines import register_backend
from kiln.server import ServerOptions
from kiln.service import Service, ServiceOptions
from kiln.testing.gated import ENTERED, GATE, GatedEngine

CONFIG = """
backend: "slow_for_shutdown_test" max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


async def test_sigterm_drains_in_flight_requests(tmp_path: Path) -> None:
    register_backend("slow_for_shutdown_test", GatedEngine)
    (tmp_path / "slow" / "1").mkdir(parents=True)
    (tmp_path / "slow" / "config.pbtxt").write_text(CONFIG)
    service = Service(ServiceOptions(ServerOptions(repositories=[tmp_path]), http_port=0, grpc_port=0,
                                     metrics_port=0, exit_timeout_s=20))
    GATE.clear()
    ENTERED.clear()
    run = asyncio.create_task(service.run())
    while "http" not in service.bound:
        await asyncio.sleep(0.01)
    url = f"http://127.0.0.1:{service.bound['http']}"
    body = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
    async with httpx.AsyncClient(timeout=30) as client:
        in_flight = asyncio.create_task(client.post(f"{url}/v2/models/slow/infer", json=body))
        await asyncio.to_thread(ENTERED.wait, 10)
        service.request_stop()
        await asyncio.sleep(0.2)
        assert not run.done()  # still draining
        assert not service.server.ready()
        GATE.set()
        response = await in_flight
    assert response.status_code == 200
    assert response.json()["outputs"][0]["data"] == [2.0, 3.0]
    assert await asyncio.wait_for(run, 20) == 0
    assert not service.server.live()


def test_a_second_signal_exits_at_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    service = Service(ServiceOptions(ServerOptions(repositories=[tmp_path])))
    service._on_signal(signal.SIGTERM)
    assert service._stop.is_set() and exits == []
    service._on_signal(signal.SIGINT)
    assert exits == [1]


def test_an_unloading_version_is_listed_as_unloading_until_drained(tmp_path: Path) -> None:
    from kiln.server import InferRequest, InputTensor, Server, ServerOptions
    from kiln.tensor import DataType

    register_backend("slow_for_shutdown_test", GatedEngine)
    (tmp_path / "slow" / "1").mkdir(parents=True)
    (tmp_path / "slow" / "config.pbtxt").write_text(CONFIG)
    server = Server(ServerOptions(repositories=[tmp_path], control_mode="explicit", load_models=("slow",)))
    server.start()
    GATE.clear()
    ENTERED.clear()
    x = np.ones((1, 2), np.float32)
    worker = threading.Thread(target=server.infer_sync,
                              args=(InferRequest("slow", [InputTensor("x", DataType.FP32, x.shape, x)]),))
    worker.start()
    assert ENTERED.wait(10)
    server.unload_model("slow")
    states = {(e.name, e.version): e.state for e in server.repository_index()}
    assert states[("slow", "1")] == "UNLOADING"
    GATE.set()
    worker.join(10)
    assert server.wait_unloaded(10)
    assert {(e.name, e.version): e.state for e in server.repository_index()}[("slow", "1")] == "UNAVAILABLE"
    server.close()
