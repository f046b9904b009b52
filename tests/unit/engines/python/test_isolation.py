"""Each loaded model.py has its own module state, its own sibling modules, and leaves nothing behind."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.config import open_model_dir
from kiln.engines import create_engine
from kiln.errors import InternalError

WriteModel = Callable[..., Path]

CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_INT64 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT64 dims: [ 1 ] } ]
"""

# A module-level counter: shared state would show as a count that carries over between loads.
COUNTER = """
import numpy as np
from . import offset as relative
import helper

CALLS = []

class KilnModel:
    def execute(self, requests):
        CALLS.append(1)
        return [{"Y": np.array([len(CALLS) + relative.OFFSET + helper.BONUS], dtype=np.int64)}]
"""


def _write(write_model: WriteModel, name: str, offset: int, bonus: int, versions: tuple[int, ...] = (1,)) -> Path:
    folder = write_model(name, COUNTER, CONFIG, versions)
    for version in versions:
        (folder / str(version) / "offset.py").write_text(f"OFFSET = {offset * version}\n")
        (folder / str(version) / "helper.py").write_text(f"BONUS = {bonus}\n")
    return folder


def _call(engine: kiln.Engine) -> int:
    return int(engine.infer({"X": np.zeros(1, np.int64)})["Y"][0])


def test_models_versions_and_instances_share_no_module_state(write_model: WriteModel) -> None:
    a = _write(write_model, "a", offset=100, bonus=1, versions=(1, 2))
    b = _write(write_model, "b", offset=200, bonus=2)
    spec_a = open_model_dir(a).spec
    a1, a1_again = (create_engine(spec_a, a / "1" / "model.py") for _ in range(2))
    a2 = create_engine(spec_a, a / "2" / "model.py")
    b1 = kiln.load(b)
    assert [_call(a1), _call(a1), _call(a1_again), _call(a2), _call(b1)] == [102, 103, 102, 202, 203]
    for engine in (a1, a1_again, a2, b1):
        engine.close()


def test_nothing_is_left_in_sys_modules_or_on_disk(write_model: WriteModel) -> None:
    folder = _write(write_model, "a", offset=0, bonus=0)
    modules, path = set(sys.modules), list(sys.path)
    with kiln.load(folder) as engine:
        assert "triton_python_backend_utils" in sys.modules
        loaded = set(sys.modules) - modules - {"triton_python_backend_utils"}
        assert loaded and all(name.startswith("kiln_python_model_") for name in loaded)
        assert "helper" not in sys.modules  # imported by absolute name, but private to this load
        assert _call(engine) == 1
    assert set(sys.modules) - modules <= {"triton_python_backend_utils"}
    assert sys.path == path
    assert not list(folder.rglob("__pycache__"))  # the repository is left as it was


def test_sibling_imports_only_work_while_model_py_is_imported(write_model: WriteModel) -> None:
    source = """
    import numpy as np

    class KilnModel:
        def execute(self, requests):
            import helper  # too late: the model's folders are on sys.path only during the import
            return [{"Y": requests[0].inputs["X"]}]
    """
    folder = write_model("late", source, CONFIG)
    (folder / "1" / "helper.py").write_text("")
    with kiln.load(folder) as engine, pytest.raises(InternalError, match="No module named 'helper'"):
        engine.infer({"X": np.zeros(1, np.int64)})
