"""The protocol-free Server facade over a real repository with real onnxruntime engines."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kiln.demo import build_demo_repository
from kiln.errors import (
    InvalidArgumentError,
    ModelNotFoundError,
    ModelNotReadyError,
    UnavailableError,
    UnsupportedError,
)
from kiln.server import InferRequest, InputTensor, RequestedOutput, Server, ServerOptions
from kiln.tensor import DataType


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    build_demo_repository(root)
    (root / "broken" / "1").mkdir(parents=True)
    (root / "broken" / "config.pbtxt").write_text('backend: "no_such_backend"')
    return root


@pytest.fixture
def server(repo: Path) -> Iterator[Server]:
    server = Server(ServerOptions(repositories=[repo]))
    server.start()
    yield server
    server.close()


def simple_request(batch: int = 1, **overrides: object) -> InferRequest:
    a = np.arange(16 * batch, dtype=np.int32).reshape(batch, 16)
    b = np.ones((batch, 16), dtype=np.int32)
    request = InferRequest("simple", [InputTensor("INPUT0", DataType.INT32, a.shape, a),
                                      InputTensor("INPUT1", DataType.INT32, b.shape, b)])
    for key, value in overrides.items():
        setattr(request, key, value)
    return request


def test_infer_runs_the_model_and_counts_statistics(server: Server) -> None:
    response = asyncio.run(server.infer(simple_request(batch=3, id="r1")))
    outputs = {o.name: o.data for o in response.outputs}
    a = np.arange(48, dtype=np.int32).reshape(3, 16)
    np.testing.assert_array_equal(outputs["OUTPUT0"], a + 1)
    np.testing.assert_array_equal(outputs["OUTPUT1"], a - 1)
    assert (response.model_name, response.model_version, response.id) == ("simple", "1", "r1")
    stats = server.model_statistics("simple")[0]
    assert (stats.inference_count, stats.execution_count, stats.success.count) == (3, 1, 1)
    assert stats.compute_infer.ns > 0 and 3 in stats.batch_stats


def test_infer_sync_and_output_subset(server: Server) -> None:
    response = server.infer_sync(simple_request(outputs=[RequestedOutput("OUTPUT1")]))
    assert [o.name for o in response.outputs] == ["OUTPUT1"]


def test_readiness_and_index_report_the_broken_model(server: Server, repo: Path) -> None:
    assert server.live()
    assert not server.ready()  # strict readiness: one model is unavailable
    lenient = Server(ServerOptions(repositories=[repo], strict_readiness=False))
    lenient.start()
    assert lenient.ready()
    lenient.hold_readiness(True)  # kiln serve, while its frontend workers start
    assert lenient.live() and not lenient.ready()
    lenient.hold_readiness(False)
    assert lenient.ready()
    lenient.close()
    index = {(e.name, e.version): (e.state, e.reason) for e in server.repository_index()}
    assert index[("simple", "1")] == ("READY", "")
    state, reason = index[("broken", "")]
    assert state == "UNAVAILABLE" and "no_such_backend" in reason
    ready = [e.name for e in server.repository_index(ready_only=True)]
    assert ready == ["image_classifier", "mlp", "mlp_pipeline", "mlp_postprocess", "mlp_preprocess", "repeat_int32",
                     "simple",
                     "simple_dyna_sequence", "simple_identity", "simple_int8", "simple_sequence", "simple_string",
                     "simple_string_dyna_sequence"]


def test_unknown_model_and_version(server: Server) -> None:
    with pytest.raises(ModelNotFoundError, match="Request for unknown model: 'nope' is not found"):
        server.infer_sync(simple_request(model_name="nope"))
    with pytest.raises(ModelNotFoundError, match="version 7"):
        server.infer_sync(simple_request(model_version="7"))
    with pytest.raises(InvalidArgumentError, match="failed to get model version from specified version string 'x'"):
        server.infer_sync(simple_request(model_version="x"))
    with pytest.raises(ModelNotReadyError, match="no_such_backend"):
        server.model_metadata("broken")
    assert not server.model_ready("broken") and server.model_ready("simple", "1")


@pytest.mark.parametrize(("mutate", "fragments"), [
    (lambda r: r.inputs.pop(), ["missing input(s) INPUT1"]),
    (lambda r: setattr(r.inputs[0], "name", "INPUT9"), ["unexpected input 'INPUT9'", "INPUT0, INPUT1"]),
    (lambda r: setattr(r.inputs[0], "datatype", DataType.FP32), ["'INPUT0' has datatype FP32", "expected INT32"]),
    (lambda r: setattr(r.inputs[0], "shape", (1, 8)), ["'INPUT0' has shape [1, 8]", "[-1, 16]"]),
    (lambda r: r.inputs.append(r.inputs[0]), ["'INPUT0' is given more than once"]),
    (lambda r: r.outputs.append(RequestedOutput("NOPE")), ["unknown output 'NOPE'"]),
])
def test_invalid_requests_name_model_field_and_expectation(server: Server, mutate: object,
                                                            fragments: list[str]) -> None:
    request = simple_request()
    mutate(request)  # type: ignore[operator]
    with pytest.raises(InvalidArgumentError) as caught:
        server.infer_sync(request)
    assert "model 'simple'" in str(caught.value)
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_batch_size_limits(server: Server) -> None:
    with pytest.raises(InvalidArgumentError, match=r"batch size 9; expected 1..8"):
        server.infer_sync(simple_request(batch=9))
    request = simple_request(batch=2)
    request.inputs[1] = InputTensor("INPUT1", DataType.INT32, (1, 16), np.ones((1, 16), np.int32))
    with pytest.raises(InvalidArgumentError, match="disagree on the batch size"):
        server.infer_sync(request)


def test_classification_returns_top_k_strings(server: Server) -> None:
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    plain = server.infer_sync(InferRequest("mlp", [InputTensor("INPUT0", DataType.FP32, x.shape, x)]))
    logits = plain.outputs[0].data
    request = InferRequest("mlp", [InputTensor("INPUT0", DataType.FP32, x.shape, x)],
                           outputs=[RequestedOutput("OUTPUT0", classification=2)])
    out = server.infer_sync(request).outputs[0]
    assert out.datatype is DataType.BYTES and out.shape == (2, 2)
    for row, logit_row in zip(out.data, logits, strict=True):
        top = np.argsort(-logit_row)[:2]
        assert [entry.decode() for entry in row] == [f"{logit_row[i]:f}:{i}" for i in top]


def test_metadata_and_config(server: Server) -> None:
    meta = server.model_metadata("simple")
    assert meta.versions == ["1"] and meta.platform == "onnxruntime_onnx" and meta.batching
    assert [t.name for t in meta.inputs] == ["INPUT0", "INPUT1"]
    assert server.model_config("simple").max_batch_size == 8
    assert server.metadata()["name"] == "kiln"


def test_control_mode_none_refuses_load_and_unload(server: Server) -> None:
    with pytest.raises(UnsupportedError, match="model control mode 'none'"):
        server.load_model("simple")
    with pytest.raises(UnsupportedError, match="model control mode 'none'"):
        server.unload_model("simple")


def test_shutdown_refuses_new_requests(server: Server) -> None:
    server.begin_shutdown()
    assert not server.ready()
    with pytest.raises(UnavailableError, match="shutting down"):
        server.infer_sync(simple_request())


def test_duplicate_model_names_across_repositories(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    build_demo_repository(first)
    build_demo_repository(second)
    server = Server(ServerOptions(repositories=[first, second]))
    server.start()
    try:
        reasons = {e.name: e.reason for e in server.repository_index()}
        assert "appears in more than one repository" in reasons["simple"]
        assert str(first / "simple") in reasons["simple"] and str(second / "simple") in reasons["simple"]
        with pytest.raises(ModelNotReadyError, match="more than one repository"):
            server.infer_sync(simple_request())
    finally:
        server.close()
