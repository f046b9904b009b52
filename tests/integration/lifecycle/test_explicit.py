"""Explicit mode: start-up loads, the load/unload API, config overrides, staged files and path safety."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kiln.errors import InvalidArgumentError, ModelNotFoundError, ModelNotReadyError
from kiln.server import InferRequest, InputTensor, Server, ServerOptions
from kiln.tensor import DataType

from ._models import add_model, write_model


def infer(server: Server, name: str = "adder") -> tuple[str, float]:
    x = np.zeros((1, 4), np.float32)
    response = server.infer_sync(InferRequest(name, [InputTensor("x", DataType.FP32, x.shape, x)]))
    return response.model_version, float(response.outputs[0].data[0, 0])


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    write_model(tmp_path, "adder", [1])
    write_model(tmp_path, "other", [5])
    return tmp_path


@pytest.fixture
def server(repo: Path) -> Iterator[Server]:
    server = Server(ServerOptions(repositories=[repo], control_mode="explicit", load_models=("adder",)))
    server.start()
    yield server
    server.close()


def states(server: Server) -> dict[str, str]:
    return {e.name: e.state for e in server.repository_index()}


def test_only_named_models_load_at_start(server: Server) -> None:
    assert states(server) == {"adder": "READY", "other": "UNAVAILABLE"}
    assert {e.name: e.reason for e in server.repository_index()}["other"] == "not loaded"
    assert server.ready()  # strict readiness counts the models asked for


def test_star_loads_everything(repo: Path) -> None:
    server = Server(ServerOptions(repositories=[repo], control_mode="explicit", load_models=("*",)))
    server.start()
    assert states(server) == {"adder": "READY", "other": "READY"}
    server.close()


def test_load_and_unload(server: Server) -> None:
    server.load_model("other")
    assert infer(server, "other") == ("5", 5.0)
    server.unload_model("other")
    with pytest.raises(ModelNotReadyError, match="unloaded"):
        infer(server, "other")
    assert server.ready()
    with pytest.raises(ModelNotFoundError, match="no model folder named 'ghost'"):
        server.load_model("ghost")


def test_load_with_a_config_override(server: Server) -> None:
    config = {"name": "adder", "backend": "onnxruntime", "max_batch_size": 2,
              "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
              "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [4]}]}
    server.load_model("adder", config=json.dumps(config))
    assert server.model_config("adder").max_batch_size == 2
    with pytest.raises(InvalidArgumentError, match="'config' parameter is not a valid model configuration"):
        server.load_model("adder", config='{"max_batch_size": "many"}')
    assert infer(server) == ("1", 1.0)  # a failed load left the model serving


def test_load_with_staged_files(server: Server, repo: Path) -> None:
    files = {"file:3/model.onnx": add_model(30.0).SerializeToString()}
    server.load_model("adder", files=files)
    assert infer(server) == ("3", 30.0)
    staged = list((repo / "adder" / ".kiln-staging").rglob("model.onnx"))
    assert len(staged) == 1 and staged[0].parent.name == "3"
    assert not (repo / "adder" / "3").exists()  # the repository itself is untouched
    server.unload_model("adder")
    assert server.wait_unloaded(30)
    assert list((repo / "adder" / ".kiln-staging").iterdir()) == []  # the staged copy goes with its version


def test_a_newer_staged_load_removes_the_older_copy(server: Server, repo: Path) -> None:
    server.load_model("adder", files={"file:3/model.onnx": add_model(30.0).SerializeToString()})
    first = next((repo / "adder" / ".kiln-staging").iterdir())
    server.load_model("adder", files={"file:3/model.onnx": add_model(31.0).SerializeToString()})
    assert infer(server) == ("3", 31.0)
    assert server.wait_unloaded(30)
    assert not first.exists()
    assert len(list((repo / "adder" / ".kiln-staging").iterdir())) == 1


@pytest.mark.parametrize("key", [
    "file:../evil.onnx", "file:/etc/passwd", "file:1/../../evil", "file:1/..", "file:..\\\\evil", "file:",
    "file:1/sub/../../../evil", "file:model.onnx", "file:1/\x00", "file://host/1/model.onnx",
])
def test_path_traversal_is_rejected(server: Server, repo: Path, key: str) -> None:
    before = sorted(p for p in repo.parent.rglob("*"))
    with pytest.raises(InvalidArgumentError, match="failed to load 'adder'"):
        server.load_model("adder", files={key: b"x"})
    assert sorted(p for p in repo.parent.rglob("*")) == before
    assert infer(server) == ("1", 1.0)


@pytest.mark.parametrize("name", ["../adder", "a/b", "..", ".hidden", "a\\b", ""])
def test_bad_model_names_are_rejected(server: Server, name: str) -> None:
    with pytest.raises(InvalidArgumentError, match="invalid model name"):
        server.load_model(name)
    with pytest.raises(InvalidArgumentError, match="invalid model name"):
        server.unload_model(name)


def test_a_failed_staged_reload_is_an_error_and_leaves_nothing_behind(server: Server, repo: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="failed to load 'adder'"):
        server.load_model("adder", files={"file:1/model.onnx": b"not an onnx model"})
    assert infer(server) == ("1", 1.0)  # the previous version keeps serving
    staging = repo / "adder" / ".kiln-staging"
    assert not staging.exists() or list(staging.iterdir()) == []


def test_config_file_names_cannot_leave_the_model_folder(server: Server) -> None:
    config = {"name": "adder", "backend": "onnxruntime", "max_batch_size": 8,
              "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [4], "label_filename": "/etc/hostname"}]}
    with pytest.raises(InvalidArgumentError, match="label_filename is '/etc/hostname'"):
        server.load_model("adder", config=json.dumps(config))
    config["output"][0]["label_filename"] = ""  # type: ignore[index]
    config["default_model_filename"] = "../../other.onnx"
    with pytest.raises(InvalidArgumentError, match="default_model_filename is '../../other.onnx'"):
        server.load_model("adder", config=json.dumps(config))
