"""Business logic scripting: a Python model served by kiln.Server calls the server's other models from execute
(``InferenceRequest.exec`` and ``async_exec``), and gets failures back in the response, as on Triton."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.demo import build_demo_repository
from kiln.errors import InternalError, UnsupportedError
from kiln.server import InferRequest, InputTensor, Server, ServerOptions
from kiln.tensor import DataType

CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "DIFF" data_type: TYPE_INT32 dims: [ 16 ] } ]
"""

# SUM = X + X through `simple`; DIFF = (X + X) - X, a second call that uses the first one's answer.
SYNC = """
import numpy as np
import triton_python_backend_utils as pb_utils

def simple(a, b, outputs, model="simple"):
    request = pb_utils.InferenceRequest(model_name=model, requested_output_names=outputs,
                                        inputs=[pb_utils.Tensor("INPUT0", a), pb_utils.Tensor("INPUT1", b)])
    return request.exec()

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            model = "no_such_model" if (x < 0).any() else "simple"
            first = simple(x, x, ["OUTPUT0"], model)
            if first.has_error():
                raise pb_utils.TritonModelException(first.error().message())
            total = pb_utils.get_output_tensor_by_name(first, "OUTPUT0").as_numpy()
            second = simple(total, x, ["OUTPUT1"])
            diff = pb_utils.get_output_tensor_by_name(second, "OUTPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SUM", total), pb_utils.Tensor("DIFF", diff)]))
        return responses
"""

# The same with `async def execute`: both calls in flight at once.
ASYNC = """
import asyncio
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            calls = [pb_utils.InferenceRequest(model_name="simple", requested_output_names=[name],
                                               inputs=[pb_utils.Tensor("INPUT0", x), pb_utils.Tensor("INPUT1", x)])
                     for name in ("OUTPUT0", "OUTPUT1")]
            first, second = await asyncio.gather(*(call.async_exec() for call in calls))
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", pb_utils.get_output_tensor_by_name(first, "OUTPUT0").as_numpy()),
                pb_utils.Tensor("DIFF", pb_utils.get_output_tensor_by_name(second, "OUTPUT1").as_numpy())]))
        return responses
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bls")
    build_demo_repository(root)
    for name, source in (("bls_sync", SYNC), ("bls_async", ASYNC)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(source)
        (root / name / "config.pbtxt").write_text(CONFIG)
    return root


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[Server]:
    instance = Server(ServerOptions(repositories=[repo], control_mode="explicit",
                                    load_models=["simple", "bls_sync", "bls_async"]))
    instance.start()
    yield instance
    instance.close()


def _request(model: str, x: np.ndarray) -> InferRequest:
    return InferRequest(model, [InputTensor("X", DataType.INT32, x.shape, x)])


X = np.arange(16, dtype=np.int32).reshape(1, 16)


@pytest.mark.parametrize("model", ["bls_sync", "bls_async"])
async def test_a_python_model_calls_another_model_of_its_server(server: Server, model: str) -> None:
    before = server.model_statistics("simple")[0].success.count
    response = await server.infer(_request(model, X))
    outputs = {output.name: output.data for output in response.outputs}
    assert outputs["SUM"].tolist() == (X + X).tolist()
    assert outputs["DIFF"].tolist() == (X if model == "bls_sync" else X - X).tolist()
    assert server.model_statistics("simple")[0].success.count == before + 2  # both calls went through `simple`


def test_blocking_callers_reach_the_server_too(server: Server) -> None:
    response = server.infer_sync(_request("bls_sync", X))
    assert {o.name: o.data for o in response.outputs}["SUM"].tolist() == (X + X).tolist()


def test_a_failed_call_comes_back_in_the_response(server: Server) -> None:
    # The model turns the error response into TritonModelException, as Triton's examples do.
    with pytest.raises(InternalError, match="no_such_model"):
        server.infer_sync(_request("bls_sync", -X))
    assert server.infer_sync(_request("bls_sync", X)).outputs  # the model serves on


def test_a_model_loaded_alone_has_no_server_to_call(repo: Path) -> None:
    with kiln.load(repo / "bls_sync") as engine, pytest.raises(UnsupportedError, match="needs a kiln server"):
        engine.infer({"X": X})
