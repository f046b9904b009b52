"""Python models served by kiln.Server: dynamic batching, per-request answers, typed errors, load and unload."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kiln.demo import build_demo_repository
from kiln.errors import InternalError, InvalidArgumentError
from kiln.server import InferRequest, InputTensor, RequestedOutput, Server, ServerOptions
from kiln.tensor import DataType

# Reports how many rows each execute() call saw, so the test can tell that requests were batched.
BATCHED = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.marker = args["model_repository"] + "/finalized"

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if (x < 0).any():
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("X must not be negative", pb_utils.TritonError.INVALID_ARG)))
                continue
            if (x == 13).any():
                raise RuntimeError("unlucky input")
            rows = np.full((x.shape[0], 1), x.shape[0], dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 10), pb_utils.Tensor("ROWS", rows)]))
        return responses

    def finalize(self):
        with open(self.marker, "w") as f:
            f.write("bye")
"""

PLAIN_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_INT32 dims: [ 2 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 2 ] }, { name: "ROWS" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 2 } ]
"""
# Waits (up to 5 s) until four requests are queued, then runs them as one batch.
BATCHED_CONFIG = PLAIN_CONFIG + "dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 5000000 }"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    build_demo_repository(tmp_path)
    broken = "class TritonPythonModel:\n    def execute(self, r:\n"
    for name, source, config in (("batched", BATCHED, BATCHED_CONFIG), ("plain", BATCHED, PLAIN_CONFIG),
                                 ("broken", broken, PLAIN_CONFIG)):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "1" / "model.py").write_text(source)
        (tmp_path / name / "config.pbtxt").write_text(config)
    return tmp_path


@pytest.fixture
def server(repo: Path) -> Iterator[Server]:
    server = Server(ServerOptions(repositories=[repo], strict_readiness=False))
    server.start()
    yield server
    server.close()


def batched(rows: list[list[int]], outputs: tuple[str, ...] = (), model: str = "batched") -> InferRequest:
    x = np.array(rows, dtype=np.int32)
    return InferRequest(model, [InputTensor("X", DataType.INT32, x.shape, x)],
                        outputs=[RequestedOutput(name) for name in outputs])


def strings(values: np.ndarray) -> np.ndarray:
    return np.array([str(v).encode() for v in values.reshape(-1)], dtype=object).reshape(values.shape)


async def test_batched_requests_each_get_their_own_rows(server: Server) -> None:
    answers = await asyncio.gather(*(server.infer(batched([[i, i + 1]])) for i in range(4)))
    for i, answer in enumerate(answers):
        outputs = {o.name: o.data for o in answer.outputs}
        np.testing.assert_array_equal(outputs["Y"], [[10 * i, 10 * (i + 1)]])
        assert outputs["ROWS"].tolist() == [[4]]  # all four ran in one execute() call
    assert server.model_statistics("batched")[0].execution_count == 1


def test_simple_string_from_the_demo_repository(server: Server) -> None:
    a = np.arange(16, dtype=np.int64).reshape(1, 16)
    b = np.full((1, 16), 5, dtype=np.int64)
    request = InferRequest("simple_string", [InputTensor("INPUT0", DataType.BYTES, a.shape, strings(a)),
                                             InputTensor("INPUT1", DataType.BYTES, b.shape, strings(b))])
    response = server.infer_sync(request)
    outputs = {o.name: o for o in response.outputs}
    assert outputs["OUTPUT0"].datatype is DataType.BYTES and outputs["OUTPUT0"].shape == (1, 16)
    assert outputs["OUTPUT0"].data.tolist() == strings(a + b).tolist()
    assert outputs["OUTPUT1"].data.tolist() == strings(a - b).tolist()


def test_model_errors_are_typed_and_the_model_keeps_serving(server: Server) -> None:
    with pytest.raises(InvalidArgumentError, match="^model 'plain': X must not be negative$"):
        server.infer_sync(batched([[-1, 0]], model="plain"))
    with pytest.raises(InternalError, match=r"model 'plain': model.py execute\(\) raised RuntimeError: unlucky"):
        server.infer_sync(batched([[13, 0]], model="plain"))
    answer = server.infer_sync(batched([[1, 2], [3, 4]], outputs=("Y",), model="plain"))
    assert [o.name for o in answer.outputs] == ["Y"]
    np.testing.assert_array_equal(answer.outputs[0].data, [[10, 20], [30, 40]])
    stats = server.model_statistics("plain")[0]
    assert (stats.success.count, stats.fail.count) == (1, 2)


def test_a_model_py_that_does_not_import_is_unavailable_with_the_reason(server: Server) -> None:
    index = {e.name: (e.state, e.reason) for e in server.repository_index()}
    state, reason = index["broken"]
    assert state == "UNAVAILABLE" and "importing" in reason and "SyntaxError" in reason
    assert index["batched"][0] == index["plain"][0] == index["simple_string"][0] == "READY"


def test_unloading_runs_finalize(repo: Path) -> None:
    server = Server(ServerOptions(repositories=[repo], control_mode="explicit", load_models=("plain",)))
    server.start()
    try:
        assert server.infer_sync(batched([[1, 1]], model="plain")).outputs[0].data.tolist() == [[10, 10]]
        server.unload_model("plain")
    finally:
        server.close()
    assert (repo / "plain" / "finalized").read_text() == "bye"
