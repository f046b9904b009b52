"""The identity engine: output i is input i (the same object), for tests and serving-overhead benchmarks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.config import open_model_dir
from kiln.config.spec import ModelSpec
from kiln.engines import EngineOptions, create_engine
from kiln.engines.identity import IdentityEngine
from kiln.errors import ConfigError, InvalidArgumentError
from kiln.testing import write_model

TWO = """backend: "identity"
max_batch_size: 8
input [ { name: "A" data_type: TYPE_FP32 dims: [ 3 ] }, { name: "B" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "X" data_type: TYPE_FP32 dims: [ 3 ] }, { name: "Y" data_type: TYPE_STRING dims: [ -1 ] } ]
"""


def _spec(tmp_path: Path, text: str) -> ModelSpec:
    return open_model_dir(write_model(tmp_path, "id", None, text)).spec


def test_returns_the_input_objects(tmp_path: Path) -> None:
    engine = create_engine(_spec(tmp_path, TWO), tmp_path / "id" / "1")
    assert isinstance(engine, IdentityEngine)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([[b"x"], [b"yz"]], dtype=object)
    out = engine.infer({"A": a, "B": b})
    assert list(out) == ["X", "Y"]
    assert out["X"] is a
    assert out["Y"] is b


def test_output_subset(tmp_path: Path) -> None:
    engine = create_engine(_spec(tmp_path, TWO), tmp_path / "id" / "1", EngineOptions())
    a = np.zeros((1, 3), dtype=np.float32)
    b = np.array([[b""]], dtype=object)
    out = engine.infer({"A": a, "B": b}, outputs=["Y"])
    assert list(out) == ["Y"] and out["Y"] is b


def test_inputs_are_still_checked(tmp_path: Path) -> None:
    engine = create_engine(_spec(tmp_path, TWO), tmp_path / "id" / "1")
    with pytest.raises(InvalidArgumentError, match="model 'id': input 'A' has dtype float64; expected FP32"):
        engine.infer({"A": np.zeros((1, 3)), "B": np.array([[b""]], dtype=object)})


def test_extra_inputs_are_allowed(tmp_path: Path) -> None:
    text = TWO.replace('output [ { name: "X" data_type: TYPE_FP32 dims: [ 3 ] }, ', "output [ ").replace(
        '{ name: "Y" data_type: TYPE_STRING dims: [ -1 ] } ]', '{ name: "X" data_type: TYPE_FP32 dims: [ 3 ] } ]')
    engine = create_engine(_spec(tmp_path, text), tmp_path / "id" / "1")
    a = np.zeros((1, 3), dtype=np.float32)
    assert engine.infer({"A": a, "B": np.array([[b""]], dtype=object)})["X"] is a


def test_dtype_pairing_is_validated(tmp_path: Path) -> None:
    text = TWO.replace('name: "Y" data_type: TYPE_STRING', 'name: "Y" data_type: TYPE_INT32')
    spec = _spec(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        create_engine(spec, tmp_path / "id" / "1")
    assert str(info.value) == (
        "model 'id': identity output 'Y' is TYPE_INT32 but input 'B' is TYPE_STRING; they must match"
    )


def test_more_outputs_than_inputs(tmp_path: Path) -> None:
    text = TWO.replace(', { name: "B" data_type: TYPE_STRING dims: [ -1 ] } ]', " ]", 1)
    with pytest.raises(ConfigError) as info:
        create_engine(_spec(tmp_path, text), tmp_path / "id" / "1")
    assert str(info.value) == (
        "model 'id': the identity backend needs at least as many inputs as outputs (1 inputs, 2 outputs)"
    )


def test_load_an_identity_model_folder(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "id", None, TWO)  # no model file: the identity backend needs none
    with kiln.load(folder) as engine:
        a = np.ones((4, 3), dtype=np.float32)
        b = np.array([["s"]] * 4)
        out = engine.infer({"A": a, "B": b})
        assert out["X"] is a and out["Y"] is b
