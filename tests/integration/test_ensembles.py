"""Ensembles served by kiln.Server: results, concurrency of independent steps, no copies between steps, dynamic
batching inside steps, statistics per step and for the whole, errors, and readiness that follows the models the
steps call."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiln.demo import build_demo_repository
from kiln.errors import InvalidArgumentError, ModelNotReadyError
from kiln.frontends.metrics import metrics_registry, render_metrics
from kiln.server import InferRequest, InferResponse, InputTensor, Server, ServerOptions
from kiln.server.ensemble import EnsembleScheduler
from kiln.tensor import DataType
from kiln.testing.repo import onnx_add_sub_model, onnx_identity_model, write_model

# out = in * factor after sleeping ``delay`` seconds (both from the config's parameters).
SLOW_SCALE = """
import json, time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"])["parameters"]
        self.factor = float(parameters["factor"]["string_value"])
        self.delay = float(parameters["delay"]["string_value"])

    def execute(self, requests):
        time.sleep(self.delay)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * self.factor)]) for r in requests]
"""


def slow_scale_config(factor: float, delay: float) -> str:
    return f"""backend: "python"
max_batch_size: 8
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
parameters {{ key: "factor" value {{ string_value: "{factor}" }} }}
parameters {{ key: "delay" value {{ string_value: "{delay}" }} }}
"""


# A -> add_sub(A, A) -> s; then s -> double (slow) -> D and s -> triple (slow) -> T, independent of each other.
DIAMOND = """name: "diamond"
platform: "ensemble"
max_batch_size: 4
input [ { name: "A" data_type: TYPE_FP32 dims: [4] } ]
output [ { name: "D" data_type: TYPE_FP32 dims: [4] }, { name: "T" data_type: TYPE_FP32 dims: [4] } ]
ensemble_scheduling { step [
  { model_name: "add_sub" model_version: -1 input_map [ { key: "INPUT0" value: "A" }, { key: "INPUT1" value: "A" } ]
    output_map { key: "OUTPUT0" value: "s" } },
  { model_name: "double" model_version: 1 input_map { key: "X" value: "s" } output_map { key: "Y" value: "D" } },
  { model_name: "triple" model_version: -1 input_map { key: "X" value: "s" } output_map { key: "Y" value: "T" } }
] }
"""

# One step through a model that waits until four requests are queued and runs them as one batch.
BATCHING = """name: "batching"
platform: "ensemble"
max_batch_size: 4
input [ { name: "A" data_type: TYPE_FP32 dims: [4] } ]
output [ { name: "B" data_type: TYPE_FP32 dims: [4] } ]
ensemble_scheduling { step [
  { model_name: "batched_ident" model_version: -1 input_map { key: "INPUT0" value: "A" }
    output_map { key: "OUTPUT0" value: "B" } }
] }
"""
BATCHED_IDENT = """backend: "onnxruntime"
max_batch_size: 4
dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 5000000 }
"""

DELAY_S = 0.4


def build_repo(root: Path) -> Path:
    build_demo_repository(root)
    write_model(root, "add_sub", onnx_add_sub_model())
    write_model(root, "batched_ident", onnx_identity_model(), BATCHED_IDENT)
    for name, factor in (("double", 2.0), ("triple", 3.0)):
        write_model(root, name, None, slow_scale_config(factor, DELAY_S))
        (root / name / "1" / "model.py").write_text(SLOW_SCALE)
    write_model(root, "diamond", None, DIAMOND)
    write_model(root, "batching", None, BATCHING)
    return root


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    server = Server(ServerOptions(repositories=[build_repo(tmp_path)]))
    assert server.start() == []
    yield server
    server.close()


def fp32(name: str, data: np.ndarray) -> InputTensor:
    return InputTensor(name, DataType.FP32, data.shape, data.astype(np.float32))


def outputs(response: InferResponse) -> dict[str, np.ndarray]:
    return {o.name: o.data for o in response.outputs}


def test_independent_steps_run_concurrently(server: Server) -> None:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    started = time.monotonic()
    response = server.infer_sync(InferRequest("diamond", [fp32("A", a)]))
    elapsed = time.monotonic() - started
    np.testing.assert_allclose(outputs(response)["D"], 4 * a)
    np.testing.assert_allclose(outputs(response)["T"], 6 * a)
    assert response.model_name == "diamond" and response.model_version == "1"
    # The two slow steps wait DELAY_S each: run one after the other they would take 2 * DELAY_S.
    assert elapsed < 1.75 * DELAY_S, f"the independent steps took {elapsed:.2f}s: they did not overlap"


def test_tensors_pass_between_steps_without_copies(server: Server) -> None:
    version = next(v for v in server._models["diamond"].versions.values())
    scheduler = version.scheduler
    assert isinstance(scheduler, EnsembleScheduler)
    seen: list[tuple[InferRequest, InferResponse]] = []
    real_dispatch = scheduler._dispatch

    async def recording(request: InferRequest) -> InferResponse:
        response = await real_dispatch(request)
        seen.append((request, response))
        return response

    scheduler._dispatch = recording
    a = np.ones((1, 4), dtype=np.float32)
    request = InferRequest("diamond", [fp32("A", a)])
    response = server.infer_sync(request)
    by_model = {r.model_name: (r, resp) for r, resp in seen}
    assert by_model["add_sub"][0].inputs[0].data is request.inputs[0].data  # the client's array, as is
    produced = by_model["add_sub"][1].outputs[0].data
    assert by_model["double"][0].inputs[0].data is produced
    assert by_model["triple"][0].inputs[0].data is produced
    assert outputs(response)["D"] is by_model["double"][1].outputs[0].data


def test_dynamic_batching_still_applies_inside_a_step(server: Server) -> None:
    async def four_at_once() -> list[InferResponse]:
        requests = [InferRequest("batching", [fp32("A", np.full((1, 4), i))]) for i in range(4)]
        return await asyncio.gather(*(server.infer(r) for r in requests))

    responses = asyncio.run(four_at_once())
    for i, response in enumerate(responses):
        np.testing.assert_array_equal(outputs(response)["B"], np.full((1, 4), i, dtype=np.float32))
    stats = server.model_statistics("batched_ident")[0]
    assert (stats.inference_count, stats.execution_count) == (4, 1)  # one batch of four
    assert stats.batch_stats[4].compute_infer.count == 1


def test_statistics_for_the_whole_and_per_step(server: Server) -> None:
    a = np.ones((3, 4), dtype=np.float32)
    for _ in range(2):
        server.infer_sync(InferRequest("diamond", [fp32("A", a)]))
    whole = server.model_statistics("diamond")[0]
    assert (whole.success.count, whole.inference_count, whole.execution_count) == (2, 6, 2)
    assert whole.success.ns >= 2 * DELAY_S * 1e9
    steps = server.ensemble_step_statistics("diamond")
    assert [(s.index, s.model_name, s.success.count, s.fail.count) for s in steps] == \
        [(0, "add_sub", 2, 0), (1, "double", 2, 0), (2, "triple", 2, 0)]
    assert steps[1].success.ns >= 2 * DELAY_S * 1e9
    assert server.model_statistics("double")[0].inference_count == 6  # the step's model counts them too
    with pytest.raises(InvalidArgumentError, match="model 'add_sub' is not an ensemble"):
        server.ensemble_step_statistics("add_sub")
    families = {f.name: f for f in text_string_to_metric_families(render_metrics(metrics_registry(server)).decode())}
    samples = {(s.labels["step"], s.labels["step_model"]): s.value
               for s in families["kiln_ensemble_step_success"].samples if s.labels["model"] == "diamond"}
    assert samples == {("0", "add_sub"): 2, ("1", "double"): 2, ("2", "triple"): 2}


def test_the_demo_pipeline_matches_its_steps_run_by_hand(server: Server) -> None:
    raw = np.random.default_rng(3).integers(0, 256, (5, 64)).astype(np.int32)
    response = outputs(server.infer_sync(InferRequest("mlp_pipeline", [InputTensor("RAW", DataType.INT32,
                                                                                     raw.shape, raw)])))
    features = ((raw.astype(np.float32) - 127.5) / 64.0).astype(np.float32)
    logits = outputs(server.infer_sync(InferRequest("mlp", [fp32("INPUT0", features)])))["OUTPUT0"]
    expected = np.exp(logits - logits.max(axis=1, keepdims=True))
    expected /= expected.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(response["PROBS"], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(response["CLASS"][:, 0], expected.argmax(axis=1))
    assert response["CLASS"].dtype == np.int32


def test_a_failing_step_fails_only_its_request(server: Server) -> None:
    bad = np.full((1, 64), 300, dtype=np.int32)
    with pytest.raises(InvalidArgumentError, match="ensemble 'mlp_pipeline' step 0 \\(model 'mlp_preprocess'\\): "
                                                   ".*input 'RAW' holds values from 300 to 300; expected counts"):
        server.infer_sync(InferRequest("mlp_pipeline", [InputTensor("RAW", DataType.INT32, bad.shape, bad)]))
    good = np.zeros((1, 64), dtype=np.int32)
    server.infer_sync(InferRequest("mlp_pipeline", [InputTensor("RAW", DataType.INT32, good.shape, good)]))
    assert server.model_statistics("mlp_pipeline")[0].fail.count == 1
    assert server.model_statistics("mlp_pipeline")[0].success.count == 1
    steps = server.ensemble_step_statistics("mlp_pipeline")
    assert [(s.success.count, s.fail.count) for s in steps] == [(1, 1), (1, 0), (1, 0)]
    with pytest.raises(InvalidArgumentError, match="model 'mlp_pipeline': input 'RAW' has datatype FP32; "
                                                   "expected INT32"):
        server.infer_sync(InferRequest("mlp_pipeline", [fp32("RAW", bad)]))


def explicit_server(root: Path, *load: str) -> Server:
    server = Server(ServerOptions(repositories=[root], control_mode="explicit", load_models=load))
    server.start()
    return server


def test_loading_an_ensemble_loads_the_models_its_steps_call(tmp_path: Path) -> None:
    server = explicit_server(build_repo(tmp_path))
    try:
        server.load_model("diamond")
        assert all(server.model_ready(name) for name in ("diamond", "add_sub", "double", "triple"))
        assert not server.model_ready("mlp")
    finally:
        server.close()


def test_unloading_a_step_model_makes_the_ensemble_unavailable_until_it_returns(tmp_path: Path) -> None:
    server = explicit_server(build_repo(tmp_path), "diamond")
    try:
        assert server.model_ready("diamond")
        server.unload_model("triple")
        assert not server.model_ready("diamond")
        entry = next(e for e in server.repository_index() if e.name == "diamond")
        assert entry.state == "UNAVAILABLE"
        assert "step 2 (model 'triple') cannot run: model 'triple' is not loaded (unloaded)" in entry.reason
        with pytest.raises(ModelNotReadyError, match="model 'diamond' has no version ready to serve: .*'triple'"):
            server.infer_sync(InferRequest("diamond", [fp32("A", np.ones((1, 4)))]))
        assert not server.ready()  # strict readiness: a wanted model is not ready
        server.load_model("triple")
        assert server.model_ready("diamond")
        response = server.infer_sync(InferRequest("diamond", [fp32("A", np.ones((1, 4)))]))
        np.testing.assert_allclose(outputs(response)["T"], np.full((1, 4), 6.0))
    finally:
        server.close()


def test_unload_dependents_unloads_the_step_models_no_other_ensemble_calls(tmp_path: Path) -> None:
    root = build_repo(tmp_path)
    write_model(root, "doubler", None, DIAMOND.replace('name: "diamond"', 'name: "doubler"').replace(
        'output [ { name: "D" data_type: TYPE_FP32 dims: [4] }, { name: "T" data_type: TYPE_FP32 dims: [4] } ]',
        'output [ { name: "D" data_type: TYPE_FP32 dims: [4] } ]').replace(
        '  { model_name: "triple" model_version: -1 input_map { key: "X" value: "s" } output_map { key: "Y" value: '
        '"T" } }\n', "").replace('value: "D" } },', 'value: "D" } }'))
    server = explicit_server(root, "diamond", "doubler")
    try:
        assert server.model_ready("doubler")
        server.unload_model("diamond", unload_dependents=True)
        assert not server.model_ready("diamond") and not server.model_ready("triple")
        assert server.model_ready("add_sub") and server.model_ready("double")  # doubler still calls them
        assert server.model_ready("doubler")
        server.unload_model("doubler")  # without unload_dependents: its step models stay
        assert server.model_ready("add_sub") and server.model_ready("double")
    finally:
        server.close()
