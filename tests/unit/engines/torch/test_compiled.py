"""Compiled models on the CPU: an AOTInductor package and torch.compile. Both compile C++ for tens of seconds."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import kiln
from kiln.engines.torch import TorchEngine
from kiln.engines.torch.loading import ModelFormat
from kiln.errors import ConfigError

from ._models import TWO_HEADS_IO, TwoHeads, X, Y, config, require_loadable_aoti, write_model_folder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def inductor_imported() -> None:
    """Import inductor once with its import-time warning silenced: torch 2.13's torch.utils.mkldnn, which inductor
    imports, defines TorchScript classes and so warns that `torch.jit.script_method` is deprecated. A module is
    imported once, so neither compiling below nor the engine's first compiled call warns again."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated",
                                category=DeprecationWarning)
        import torch._inductor.compile_fx  # noqa: F401



@pytest.fixture(scope="module")
def aoti_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("aoti") / "model.pt2"
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(TwoHeads().eval(), (torch.from_numpy(X), torch.from_numpy(Y)),
                                  dynamic_shapes={"x": {0: batch}, "y": {0: batch}})
    with warnings.catch_warnings():
        # torch 2.13's packaging pickles a pytree spec through a deprecated isinstance check; not ours to fix.
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        torch._inductor.aoti_compile_and_package(program, package_path=str(path))
    require_loadable_aoti(path)
    return path


def eager(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with torch.inference_mode():
        first, second = TwoHeads().eval()(torch.from_numpy(x), torch.from_numpy(y))
    return first.numpy(), second.numpy()


def test_aoti_package_matches_the_eager_module(tmp_path: Path, aoti_package: Path) -> None:
    engine = kiln.load(write_model_folder(tmp_path, "m", config("torch_aoti", *TWO_HEADS_IO), aoti_package))
    assert isinstance(engine, TorchEngine) and engine.format is ModelFormat.AOTI and engine.thread_safe
    for rows in (3, 1):  # the package was exported with a dynamic batch dimension
        out = engine.infer({"x": X[:rows], "y": Y[:rows]})
        first, second = eager(X[:rows], Y[:rows])
        np.testing.assert_allclose(out["OUTPUT__0"], first, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out["OUTPUT__1"], second, rtol=1e-5, atol=1e-6)


def test_aoti_inputs_by_index_name(tmp_path: Path, aoti_package: Path) -> None:
    inputs = [("B__1", "TYPE_FP32", [3]), ("A__0", "TYPE_FP32", [4])]  # a package records no argument names
    engine = kiln.load(write_model_folder(tmp_path, "m", config("torch_aoti", inputs, TWO_HEADS_IO[1]), aoti_package))
    np.testing.assert_allclose(engine.infer({"A__0": X, "B__1": Y})["OUTPUT__0"], eager(X, Y)[0], rtol=1e-5)


def test_aoti_input_count_must_match(tmp_path: Path, aoti_package: Path) -> None:
    text = config("torch_aoti", [("x", "TYPE_FP32", [4])], TWO_HEADS_IO[1])
    with pytest.raises(ConfigError) as info:
        kiln.load(write_model_folder(tmp_path, "m", text, aoti_package))
    assert str(info.value) == "model 'm': the model takes 2 inputs, but the config declares 1"


def test_torch_compile_of_an_exported_program(tmp_path: Path, files: dict[str, Path]) -> None:
    text = config("torch_aoti", *TWO_HEADS_IO, parameters={"compile_mode": "default"})
    engine = kiln.load(write_model_folder(tmp_path, "m", text, files["export"]))
    assert not engine.thread_safe  # dynamo and inductor are not thread-safe
    out = engine.infer({"x": X, "y": Y})
    np.testing.assert_allclose(out["OUTPUT__1"], eager(X, Y)[1], rtol=1e-5, atol=1e-6)


def test_a_compiled_engine_compiles_while_loading_and_not_per_batch_size(tmp_path: Path,
                                                                         files: dict[str, Path]) -> None:
    from kiln.engines.torch.compile_cache import compile_counts

    text = config("torch_aoti", *TWO_HEADS_IO, parameters={"compile_mode": "default"})
    engine = kiln.load(write_model_folder(tmp_path, "m", text, files["export"]))
    assert isinstance(engine, TorchEngine) and engine.compile_cache is not None
    assert engine.compile_cache.status == "absent"  # no compile_cache.bin beside the file
    assert engine.compile_counts is not None
    # The warm-up made two graphs: one with a dynamic batch dimension, and batch 1's (torch specialises 1).
    assert engine.compile_counts.hits + engine.compile_counts.misses == 2
    before = compile_counts()
    for rows in (3, 1, 2, 8):
        out = engine.infer({"x": np.resize(X, (rows, 4)), "y": np.resize(Y, (rows, 3))})
        np.testing.assert_allclose(out["OUTPUT__1"], eager(np.resize(X, (rows, 4)), np.resize(Y, (rows, 3)))[1],
                                   rtol=1e-5, atol=1e-6)
    after = compile_counts().since(before)
    assert (after.hits, after.misses) == (0, 0), "every batch size ran a graph compiled at load"
