"""Poll mode: new, changed, broken and removed models and versions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kiln.errors import ModelNotFoundError, ModelNotReadyError, UnsupportedError
from kiln.server import InferRequest, InputTensor, Server, ServerOptions
from kiln.tensor import DataType

from ._models import CONFIG, write_model, write_version


def infer(server: Server, name: str = "adder", version: str = "") -> tuple[str, float]:
    x = np.zeros((1, 4), np.float32)
    response = server.infer_sync(InferRequest(name, [InputTensor("x", DataType.FP32, x.shape, x)],
                                              model_version=version))
    return response.model_version, float(response.outputs[0].data[0, 0])


def index(server: Server) -> dict[tuple[str, str], tuple[str, str]]:
    return {(e.name, e.version): (e.state, e.reason) for e in server.repository_index()}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    write_model(tmp_path, "adder", [1])
    server = Server(ServerOptions(repositories=[tmp_path], control_mode="poll"))
    server.start()
    yield server
    server.close()


def test_new_version_replaces_the_old_one(server: Server, tmp_path: Path) -> None:
    assert infer(server) == ("1", 1.0)
    write_version(tmp_path / "adder", 2)
    assert server.poll() == ["adder"]
    assert infer(server) == ("2", 2.0)
    assert index(server)[("adder", "1")][1] == "no longer selected by the version policy"
    assert server.wait_unloaded(30)
    assert index(server)[("adder", "1")] == ("UNAVAILABLE", "no longer selected by the version policy")
    with pytest.raises(ModelNotReadyError, match="version 1 is not available"):
        infer(server, version="1")
    assert server.poll() == []  # nothing changed since


def test_changed_model_file_is_reloaded(server: Server, tmp_path: Path) -> None:
    write_version(tmp_path / "adder", 1, constant=7.0)
    assert server.poll() == ["adder"]
    assert infer(server) == ("1", 7.0)


def test_half_copied_file_keeps_the_old_version_serving_and_is_retried(server: Server, tmp_path: Path) -> None:
    (tmp_path / "adder" / "2").mkdir()
    (tmp_path / "adder" / "2" / "model.onnx").write_bytes(b"\x08\x07partial")
    server.poll()
    assert infer(server) == ("1", 1.0)
    state, reason = index(server)[("adder", "1")]
    assert state == "READY" and "the last reload failed" in reason and "cannot read the ONNX model" in reason
    write_version(tmp_path / "adder", 2)  # the copy finishes
    assert server.poll() == ["adder"]
    assert infer(server) == ("2", 2.0)


def test_broken_config_keeps_the_old_version_serving(server: Server, tmp_path: Path) -> None:
    config = tmp_path / "adder" / "config.pbtxt"
    config.write_text(config.read_text() + "\nmax_batch_size: [")
    server.poll()
    assert infer(server) == ("1", 1.0)
    state, reason = index(server)[("adder", "1")]
    assert state == "READY" and "the last reload failed" in reason and "syntax error" in reason
    assert server.ready()
    assert server.load_failures() == {"adder": 1}
    from kiln.frontends.metrics import metrics_registry, render_metrics

    assert 'kiln_model_load_failure_count{model="adder"} 1.0' in render_metrics(metrics_registry(server)).decode()
    config.write_text(CONFIG.format(name="adder", count=1))
    server.poll()
    assert index(server)[("adder", "1")] == ("READY", "")


def test_new_and_removed_model_folders(server: Server, tmp_path: Path) -> None:
    write_model(tmp_path, "second", [3])
    assert server.poll() == ["second"]
    assert infer(server, "second") == ("3", 3.0)
    import shutil

    shutil.rmtree(tmp_path / "second")
    assert server.poll() == ["second"]
    assert server.poll() == []  # reported once
    with pytest.raises(ModelNotReadyError, match="removed from the model repository"):
        infer(server, "second")
    assert server.ready()  # a removed model is no longer awaited


def test_instance_count_change_is_applied_in_place(server: Server, tmp_path: Path) -> None:
    record = server._models["adder"].versions[1]
    assert record.loaded is not None
    first_engine = record.loaded.engines[0]
    (tmp_path / "adder" / "config.pbtxt").write_text(CONFIG.format(name="adder", count=3))
    assert server.poll() == ["adder"]
    resized = server._models["adder"].versions[1].loaded
    assert resized is not None and len(resized.engines) == 3 and resized.engines[0] is first_engine
    assert infer(server) == ("1", 1.0)
    assert resized.stats.snapshot().success.count >= 1


def test_api_load_and_unload_need_explicit_mode(server: Server) -> None:
    with pytest.raises(UnsupportedError, match="--model-control-mode=explicit"):
        server.load_model("adder")
    unknown = Server(ServerOptions(repositories=[], control_mode="poll"))
    with pytest.raises(ModelNotFoundError):
        unknown.infer_sync(InferRequest("nope", []))


def test_instance_count_can_go_up_and_back_down_without_leaking_engines(server: Server, tmp_path: Path) -> None:
    first = server._models["adder"].versions[1].loaded
    assert first is not None
    original = first.engines[0]
    config = tmp_path / "adder" / "config.pbtxt"
    config.write_text(CONFIG.format(name="adder", count=3))
    assert server.poll() == ["adder"]
    grown = server._models["adder"].versions[1].loaded
    assert grown is not None and len(grown.engines) == 3 and grown.engines[0] is original
    config.write_text(CONFIG.format(name="adder", count=1))
    assert server.poll() == ["adder"]
    assert server.wait_unloaded(30)
    shrunk = server._models["adder"].versions[1].loaded
    assert shrunk is not None and shrunk.engines == [original]
    assert [e._session is None for e in grown.engines] == [False, True, True]  # type: ignore[attr-defined]
    assert infer(server) == ("1", 1.0)
