"""The demo repository's simple_string: Triton's string example as a Triton Python model, run by kiln."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.config import open_model_dir
from kiln.demo import build_demo_repository
from kiln.errors import InvalidArgumentError
from kiln.tensor import DataType


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("demo")
    build_demo_repository(root)
    return root / "simple_string"


def _strings(values: np.ndarray) -> np.ndarray:
    return np.array([str(v).encode() for v in values.reshape(-1)], dtype=object).reshape(values.shape)


def test_the_model_file_is_the_packaged_source(demo: Path) -> None:
    packaged = resources.files("kiln.demo").joinpath("simple_string_model.py").read_bytes()
    assert (demo / "1" / "model.py").read_bytes() == packaged
    assert b"import triton_python_backend_utils as pb_utils" in packaged


def test_config_matches_tritons_example(demo: Path) -> None:
    spec = open_model_dir(demo).spec
    assert (spec.backend, spec.max_batch_size) == ("python", 8)
    assert [(t.name, t.datatype, t.dims) for t in spec.inputs] == [
        ("INPUT0", DataType.BYTES, (16,)), ("INPUT1", DataType.BYTES, (16,))]
    assert [(t.name, t.datatype, t.dims) for t in spec.outputs] == [
        ("OUTPUT0", DataType.BYTES, (16,)), ("OUTPUT1", DataType.BYTES, (16,))]


def test_sums_and_differences_as_strings(demo: Path) -> None:
    a = np.arange(-16, 16, dtype=np.int64).reshape(2, 16) * 10**12  # beyond int32: the model uses Python ints
    b = np.full((2, 16), 7, dtype=np.int64)
    with kiln.load(demo) as engine:
        out = engine.infer({"INPUT0": _strings(a), "INPUT1": _strings(b)})
    assert out["OUTPUT0"].tolist() == _strings(a + b).tolist()
    assert out["OUTPUT1"].tolist() == _strings(a - b).tolist()


def test_a_non_integer_is_an_invalid_argument(demo: Path) -> None:
    x = _strings(np.ones((1, 16), dtype=np.int64))
    bad = x.copy()
    bad[0, 3] = b"three"
    with kiln.load(demo) as engine:
        with pytest.raises(InvalidArgumentError, match="model 'simple_string': input 'INPUT1' holds b'three', "
                                                       "which is not an integer"):
            engine.infer({"INPUT0": x, "INPUT1": bad})
        assert engine.infer({"INPUT0": x, "INPUT1": x})["OUTPUT0"][0, 0] == b"2"
