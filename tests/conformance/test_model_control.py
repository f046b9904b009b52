"""The repository API through the official tritonclient against `kiln serve --model-control-mode=explicit`."""

from __future__ import annotations

import json
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


@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("repo")
    build_demo_repository(repo)
    with kiln_serve([repo], "--model-control-mode", "explicit", "--load-model", "simple") as server:
        yield server


@pytest.fixture(params=["http", "grpc"])
def client(request: pytest.FixtureRequest, explicit_server: KilnProcess) -> Iterator[Any]:
    if request.param == "http":
        yield httpclient.InferenceServerClient(explicit_server.http_url)
    else:
        yield grpcclient.InferenceServerClient(explicit_server.grpc_url)


def mlp_input(client: Any) -> list[Any]:
    module = httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient
    tensor = module.InferInput("INPUT0", [1, 64], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 64), np.float32))
    return [tensor]


def test_load_infer_unload(client: Any) -> None:
    assert client.is_model_ready("simple") and not client.is_model_ready("mlp")
    client.load_model("mlp")
    assert client.is_model_ready("mlp")
    assert client.infer("mlp", mlp_input(client)).as_numpy("OUTPUT0").shape == (1, 10)
    client.unload_model("mlp")
    assert not client.is_model_ready("mlp")
    with pytest.raises(InferenceServerException, match="unloaded"):
        client.infer("mlp", mlp_input(client))


def test_index_lists_loaded_and_unloaded_models(client: Any) -> None:
    index = client.get_model_repository_index()
    if not isinstance(index, list):
        index = [{"name": m.name, "state": m.state} for m in index.models]
    states = {entry["name"]: entry.get("state") for entry in index}
    assert states["simple"] == "READY" and states["mlp"] in ("UNAVAILABLE", "UNLOADING", "")


def test_load_with_files_and_config(client: Any, tmp_path: Path) -> None:
    build_demo_repository(tmp_path)
    model = (tmp_path / "mlp" / "1" / "model.onnx").read_bytes()
    mlp_config = json.dumps({"name": "mlp", "backend": "onnxruntime", "max_batch_size": 4})
    client.load_model("mlp", config=mlp_config, files={"file:7/model.onnx": model})
    metadata = client.get_model_metadata("mlp")
    versions = metadata["versions"] if isinstance(metadata, dict) else list(metadata.versions)
    assert versions == ["7"]
    client.unload_model("mlp")


@pytest.mark.parametrize("key", ["file:../../escape.onnx", "file:/tmp/escape.onnx"])
def test_path_traversal_is_rejected(client: Any, key: str) -> None:
    with pytest.raises(InferenceServerException) as caught:
        client.load_model("mlp", config=json.dumps({"name": "mlp"}), files={key: b"x"})
    assert "failed to load 'mlp'" in caught.value.message()
    assert str(caught.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT")
    assert client.is_model_ready("simple")
