"""Version swaps under load: no failed request, and every answer comes from exactly one version."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from kiln.server import InferRequest, InputTensor, Server, ServerOptions
from kiln.tensor import DataType

from ._models import write_model, write_version

SWAPS = 20
CLIENTS = 8


def request(value: float) -> InferRequest:
    x = np.full((1, 4), value, np.float32)
    return InferRequest("adder", [InputTensor("x", DataType.FP32, x.shape, x)])


async def test_version_swaps_under_load_lose_no_request(tmp_path: Path) -> None:
    model = write_model(tmp_path, "adder", [1])
    server = Server(ServerOptions(repositories=[tmp_path], control_mode="poll"))
    server.start()
    stop = asyncio.Event()
    answers: list[tuple[int, float]] = []
    failures: list[BaseException] = []

    async def client(seed: int) -> None:
        value = float(seed)
        while not stop.is_set():
            try:
                response = await server.infer(request(value))
            except Exception as exc:  # counted, never swallowed: the test asserts there are none
                failures.append(exc)
                continue
            version = int(response.model_version)
            y = response.outputs[0].data
            answers.append((version, float(y[0, 0] - value)))
            assert (y == y[0, 0]).all()

    clients = [asyncio.create_task(client(i)) for i in range(CLIENTS)]
    loop = asyncio.get_running_loop()
    try:
        deadline = loop.time() + 30
        while len(answers) < 10:
            assert loop.time() < deadline, "no answers within 30 s"
            await asyncio.sleep(0.001)
        for version in range(2, SWAPS + 2):
            write_version(model, version)
            changed = await loop.run_in_executor(None, server.poll)
            assert changed == ["adder"]
            before = len(answers)
            # Traffic keeps flowing between swaps, and the new version answers before the next swap.
            deadline = loop.time() + 30
            while sum(1 for v, _ in answers[before:] if v == version) < 5:
                assert loop.time() < deadline, f"version {version} answered nothing within 30 s"
                await asyncio.sleep(0.001)
            assert server.model_metadata("adder").versions == [str(version)]
    finally:
        stop.set()
        await asyncio.gather(*clients)
    assert failures == []
    assert len({v for v, _ in answers}) == SWAPS + 1
    for version, added in answers:
        assert added == version  # the answer's values match the version that claims it
    assert await loop.run_in_executor(None, server.wait_unloaded, 30)
    server.close()
