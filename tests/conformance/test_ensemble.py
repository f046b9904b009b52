"""The demo ensemble (mlp_preprocess -> mlp -> mlp_postprocess) through the official tritonclient against a real
`kiln serve`: results, metadata, config, statistics, error paths, and readiness when a step's model is unloaded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from kiln.demo import build_demo_repository
from kiln.testing.serve import KilnProcess, kiln_serve

pytestmark = pytest.mark.conformance


@pytest.fixture(params=["http", "grpc"])
def client(request: pytest.FixtureRequest, kiln_server: KilnProcess) -> Iterator[tuple[Any, Any]]:
    module: Any = httpclient if request.param == "http" else grpcclient
    raw = module.InferenceServerClient(kiln_server.http_url if request.param == "http" else kiln_server.grpc_url)
    yield raw, module
    raw.close()


def infer_pipeline(client: Any, module: Any, raw: np.ndarray, datatype: str = "INT32") -> Any:
    tensor = module.InferInput("RAW", list(raw.shape), datatype)
    tensor.set_data_from_numpy(raw)
    return client.infer("mlp_pipeline", [tensor], outputs=[module.InferRequestedOutput("PROBS"),
                                                           module.InferRequestedOutput("CLASS")])


def test_pipeline_result_equals_its_steps(client: tuple[Any, Any]) -> None:
    raw_client, module = client
    raw = np.random.default_rng(11).integers(0, 256, (4, 64)).astype(np.int32)
    result = infer_pipeline(raw_client, module, raw)
    features = ((raw.astype(np.float32) - 127.5) / 64.0).astype(np.float32)
    mlp_input = module.InferInput("INPUT0", list(features.shape), "FP32")
    mlp_input.set_data_from_numpy(features)
    logits = raw_client.infer("mlp", [mlp_input]).as_numpy("OUTPUT0")
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(result.as_numpy("PROBS"), probs, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(result.as_numpy("CLASS")[:, 0], probs.argmax(axis=1))
    response = result.get_response(as_json=True) if module is grpcclient else result.get_response()
    assert response["model_name"] == "mlp_pipeline" and response["model_version"] == "1"


def test_metadata_config_and_statistics(client: tuple[Any, Any]) -> None:
    raw_client, module = client
    as_json = {"as_json": True} if module is grpcclient else {}
    metadata = raw_client.get_model_metadata("mlp_pipeline", **as_json)
    assert metadata["platform"] == "ensemble"
    assert [t["name"] for t in metadata["inputs"]] == ["RAW"]
    assert [t["name"] for t in metadata["outputs"]] == ["PROBS", "CLASS"]
    config = raw_client.get_model_config("mlp_pipeline", **as_json)
    config = config.get("config", config)
    steps = config["ensemble_scheduling"]["step"]
    assert [s["model_name"] for s in steps] == ["mlp_preprocess", "mlp", "mlp_postprocess"]
    infer_pipeline(raw_client, module, np.zeros((2, 64), dtype=np.int32))
    stats = raw_client.get_inference_statistics("mlp_pipeline", **as_json)["model_stats"][0]
    assert int(stats["inference_stats"]["success"]["count"]) >= 1
    assert int(stats["inference_count"]) >= 2


def test_errors_name_the_ensemble_step_and_value(client: tuple[Any, Any]) -> None:
    raw_client, module = client
    with pytest.raises(InferenceServerException) as wrong_type:
        infer_pipeline(raw_client, module, np.zeros((1, 64), dtype=np.float32), "FP32")
    assert "model 'mlp_pipeline': input 'RAW' has datatype FP32; expected INT32" in wrong_type.value.message()
    with pytest.raises(InferenceServerException) as bad_value:
        infer_pipeline(raw_client, module, np.full((1, 64), 999, dtype=np.int32))
    message = bad_value.value.message()
    assert "ensemble 'mlp_pipeline' step 0 (model 'mlp_preprocess')" in message
    assert "holds values from 999 to 999; expected counts in [0, 255]" in message
    expected_status = "StatusCode.INVALID_ARGUMENT" if module is grpcclient else "400"
    assert bad_value.value.status() == expected_status
    assert infer_pipeline(raw_client, module, np.ones((1, 64), dtype=np.int32)).as_numpy("CLASS").shape == (1, 1)


def test_unloading_a_step_model_makes_the_ensemble_unavailable(tmp_path: Path) -> None:
    build_demo_repository(tmp_path)
    with kiln_serve([tmp_path], "--model-control-mode", "explicit", "--load-model", "mlp_pipeline") as server:
        client = httpclient.InferenceServerClient(server.http_url)
        try:
            # Loading the ensemble loaded the models its steps call, and nothing else.
            assert client.is_model_ready("mlp_pipeline") and client.is_model_ready("mlp")
            assert not client.is_model_ready("simple")
            client.unload_model("mlp")
            assert not client.is_model_ready("mlp_pipeline")
            index = {m["name"]: m for m in client.get_model_repository_index()}
            assert index["mlp_pipeline"]["state"] == "UNAVAILABLE"
            assert "step 1 (model 'mlp') cannot run" in index["mlp_pipeline"]["reason"]
            with pytest.raises(InferenceServerException, match="'mlp_pipeline' has no version ready"):
                infer_pipeline(client, httpclient, np.zeros((1, 64), dtype=np.int32))
            client.load_model("mlp")
            assert client.is_model_ready("mlp_pipeline")
            client.unload_model("mlp_pipeline", unload_dependents=True)
            assert not any(client.is_model_ready(name) for name in ("mlp_pipeline", "mlp", "mlp_preprocess"))
        finally:
            client.close()
