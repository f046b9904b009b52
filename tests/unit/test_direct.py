"""kiln.load(): the direct path on demo model folders and bare .onnx files, and the errors a caller can make."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest

import kiln
from kiln.demo import build_demo_repository
from kiln.engines.onnxruntime import OnnxRuntimeEngine
from kiln.errors import ConfigError, InvalidArgumentError, ModelNotFoundError, UnavailableError
from kiln.testing import onnx_add_sub_model, onnx_identity_model, write_model


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("demo")
    build_demo_repository(root)
    return root


@pytest.fixture(scope="module")
def simple(demo: Path) -> kiln.Engine:
    return kiln.load(demo / "simple")


def _ints(batch: int = 2, width: int = 16) -> np.ndarray:
    return np.arange(batch * width, dtype=np.int32).reshape(batch, width)


def test_load_demo_folder(simple: kiln.Engine) -> None:
    assert isinstance(simple, OnnxRuntimeEngine)
    assert simple.name == "simple"
    assert simple.spec.max_batch_size == 8
    a, b = _ints(), np.ones((2, 16), dtype=np.int32)
    out = simple.infer({"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)


def test_load_accepts_str_paths(demo: Path) -> None:
    with kiln.load(str(demo / "mlp")) as engine:
        out = engine.infer({"INPUT0": np.zeros((3, 64), dtype=np.float32)})
        assert out["OUTPUT0"].shape == (3, 10)
        assert out["OUTPUT0"].dtype == np.float32


def test_load_bare_onnx_file(demo: Path) -> None:
    with kiln.load(demo / "mlp" / "1" / "model.onnx") as engine:
        assert engine.name == "model"  # the file's stem
        assert engine.spec.max_batch_size == 0  # no config: the file's own dims, batch dimension included
        assert engine.inputs[0].dims == (-1, 64)
        x = np.random.default_rng(0).standard_normal((5, 64), dtype=np.float32)
        direct = engine.infer({"INPUT0": x})["OUTPUT0"]
    with kiln.load(demo / "mlp") as folder_engine:
        np.testing.assert_allclose(folder_engine.infer({"INPUT0": x})["OUTPUT0"], direct, rtol=1e-6)


def test_bare_file_has_no_versions(demo: Path) -> None:
    path = demo / "simple" / "1" / "model.onnx"
    with pytest.raises(InvalidArgumentError) as info:
        kiln.load(path, version=1)
    assert str(info.value) == f"{path}: version=1 applies to model folders, not to a model file"


def test_bare_non_onnx_file(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"")
    with pytest.raises(ConfigError) as info:
        kiln.load(path)
    assert str(info.value) == (f"{path}: kiln.load() reads .onnx files directly; put other model files in a model "
                               "folder with a config.pbtxt")


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        kiln.load(tmp_path / "nothing")
    assert str(info.value) == f"{tmp_path / 'nothing'}: no such model file or folder"


# -- versions


def _versioned(tmp_path: Path, policy: str = "") -> Path:
    """Version 1 adds in OUTPUT0; versions 2 and 3 swap the two outputs, so a result shows which one ran."""
    folder = write_model(tmp_path, "m", onnx_add_sub_model(), policy, versions=(1,))
    swapped = onnx_add_sub_model()
    swapped.graph.node[0].output[0], swapped.graph.node[1].output[0] = "OUTPUT1", "OUTPUT0"
    write_model(tmp_path, "m", swapped, None, versions=(2, 3))
    return folder


def _adds(engine: kiln.Engine) -> bool:
    x = np.full((1, 4), 3, dtype=np.float32)
    return bool(engine.infer({"INPUT0": x, "INPUT1": x})["OUTPUT0"][0, 0] == 6)


def test_newest_version_by_default(tmp_path: Path) -> None:
    assert not _adds(kiln.load(_versioned(tmp_path)))


def test_explicit_version(tmp_path: Path) -> None:
    folder = _versioned(tmp_path)
    assert _adds(kiln.load(folder, version=1))
    assert not _adds(kiln.load(folder, version=2))


def test_explicit_version_outside_the_policy_is_allowed(tmp_path: Path) -> None:
    folder = _versioned(tmp_path, "version_policy: { specific: { versions: [ 2 ] } }")
    assert _adds(kiln.load(folder, version=1))


def test_newest_served_version_follows_the_policy(tmp_path: Path) -> None:
    folder = _versioned(tmp_path, "version_policy: { specific: { versions: [ 1 ] } }")
    assert _adds(kiln.load(folder))


def test_missing_version(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        kiln.load(_versioned(tmp_path), version=7)
    assert str(info.value) == "model 'm' has no version 7 (available: 1, 2, 3)"


def test_policy_selecting_no_version(tmp_path: Path) -> None:
    folder = _versioned(tmp_path, "version_policy: { specific: { versions: [ 9 ] } }")
    with pytest.raises(ModelNotFoundError) as info:
        kiln.load(folder)
    assert str(info.value) == "model 'm': its version_policy selects none of the versions 1, 2, 3"


# -- options


def test_options(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", onnx_identity_model())
    with kiln.load(folder, kind="cpu", intra_op_threads=1, inter_op_threads=1, device_id=0) as engine:
        x = np.ones((1, 4), dtype=np.float32)
        assert engine.infer({"INPUT0": x})["OUTPUT0"] is not None


def test_unknown_option(demo: Path) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        kiln.load(demo / "simple", thread_count=2)
    message = str(info.value)
    assert message.startswith("unknown load option(s) thread_count; expected: ")
    for name in ("kind", "device_id", "intra_op_threads", "inter_op_threads", "extra"):
        assert name in message.split("expected: ")[1]


def test_unknown_option_names_only_the_unknown_ones(demo: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"^unknown load option\(s\) thread_count; expected"):
        kiln.load(demo / "simple", kind="cpu", thread_count=2)


def test_unknown_kind_is_rejected(demo: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="tpu"):
        kiln.load(demo / "simple", kind="tpu")


# -- bad inputs: every message names the model, the input, the value and what was expected


def test_unexpected_input_name(simple: kiln.Engine) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        simple.infer({"INPUT0": _ints(), "INPUT1": _ints(), "INPUT2": _ints()})
    assert str(info.value) == "model 'simple': unexpected input 'INPUT2'; expected inputs: INPUT0, INPUT1"


def test_missing_input(simple: kiln.Engine) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        simple.infer({"INPUT0": _ints()})
    assert str(info.value) == ("model 'simple': missing input 'INPUT1' (INT32 with shape [-1, 16], "
                               "first dim = batch size 1..8, -1 = any size)")


def test_wrong_dtype(simple: kiln.Engine) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        simple.infer({"INPUT0": _ints(), "INPUT1": _ints().astype(np.int64)})
    assert str(info.value) == ("model 'simple': input 'INPUT1' has dtype int64; expected INT32 (numpy int32); "
                               "convert with .astype()")


def test_strings_for_a_numeric_input(simple: kiln.Engine) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape("input 'INPUT0' has dtype <U1; expected INT32")):
        simple.infer({"INPUT0": np.array([["a"] * 16]), "INPUT1": _ints(1)})


def test_numbers_for_a_bytes_input(tmp_path: Path) -> None:
    engine = kiln.load(write_model(tmp_path, "s", onnx_identity_model(kiln.DataType.BYTES, dims=(1,))))
    with pytest.raises(InvalidArgumentError) as info:
        engine.infer({"INPUT0": np.zeros((1, 1), dtype=np.float32)})
    assert str(info.value) == ("model 's': input 'INPUT0' has dtype float32; expected BYTES "
                               "(numpy object, bytes or str)")


@pytest.mark.parametrize(
    ("shape", "shown"),
    [((2, 15), "[2, 15]"), ((16,), "[16]"), ((2, 16, 1), "[2, 16, 1]")],
)
def test_wrong_shape(simple: kiln.Engine, shape: tuple[int, ...], shown: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        simple.infer({"INPUT0": np.zeros(shape, dtype=np.int32), "INPUT1": _ints()})
    assert str(info.value) == (f"model 'simple': input 'INPUT0' has shape {shown}; expected INT32 with shape "
                               "[-1, 16], first dim = batch size 1..8, -1 = any size")


def test_batch_too_large(simple: kiln.Engine) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        simple.infer({"INPUT0": _ints(9), "INPUT1": _ints(9)})
    assert str(info.value) == "model 'simple': input 'INPUT0' has batch size 9; expected 1..8 (max_batch_size)"


def test_empty_batch(simple: kiln.Engine) -> None:
    with pytest.raises(InvalidArgumentError, match=r"input 'INPUT0' has batch size 0; expected 1\.\.8"):
        simple.infer({"INPUT0": _ints(0), "INPUT1": _ints(0)})


def test_inconsistent_batch_sizes(simple: kiln.Engine) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        simple.infer({"INPUT0": _ints(2), "INPUT1": _ints(3)})
    assert str(info.value) == ("model 'simple': inputs disagree on the batch size (INPUT0=2, INPUT1=3); "
                               "every input needs the same first dimension")


def test_max_batch_is_accepted(simple: kiln.Engine) -> None:
    out = simple.infer({"INPUT0": _ints(8), "INPUT1": _ints(8)})
    assert out["OUTPUT0"].shape == (8, 16)


def test_unbatched_model_shapes(tmp_path: Path) -> None:
    engine = kiln.load(write_model(tmp_path, "m", onnx_add_sub_model(dims=(2, 3), batch=False)))
    x = np.ones((2, 3), dtype=np.float32)
    assert engine.infer({"INPUT0": x, "INPUT1": x})["OUTPUT0"].shape == (2, 3)
    with pytest.raises(InvalidArgumentError) as info:
        engine.infer({"INPUT0": np.ones((1, 2, 3), np.float32), "INPUT1": x})
    assert str(info.value) == ("model 'm': input 'INPUT0' has shape [1, 2, 3]; expected FP32 with shape [2, 3], "
                               "-1 = any size")


def test_lists_are_accepted_as_arrays(tmp_path: Path) -> None:
    model = onnx_add_sub_model(kiln.DataType.INT64, dims=(2,), batch=False)
    engine = kiln.load(write_model(tmp_path, "m", model))
    out = engine.infer({"INPUT0": [1, 2], "INPUT1": [10, 20]})
    np.testing.assert_array_equal(out["OUTPUT0"], [11, 22])


def test_context_manager_closes(demo: Path) -> None:
    with kiln.load(demo / "simple") as engine:
        engine.infer({"INPUT0": _ints(1), "INPUT1": _ints(1)})
    with pytest.raises(UnavailableError, match="model 'simple': the engine is closed"):
        engine.infer({"INPUT0": _ints(1), "INPUT1": _ints(1)})


def test_load_folder_with_model_onnx_folder(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", None)
    (folder / "1" / "model.onnx").mkdir()
    onnx.save(onnx_add_sub_model(), str(folder / "1" / "model.onnx" / "model.onnx"))
    x = np.ones((1, 4), dtype=np.float32)
    assert kiln.load(folder).infer({"INPUT0": x, "INPUT1": x})["OUTPUT1"].tolist() == [[0, 0, 0, 0]]
    bare = kiln.load(folder / "1" / "model.onnx")  # the folder itself, loaded like a bare file
    assert bare.infer({"INPUT0": x, "INPUT1": x})["OUTPUT0"].tolist() == [[2, 2, 2, 2]]


def _simple_on_gpu(demo: Path, root: Path, gpus: str) -> Path:
    """The demo ``simple`` folder with a KIND_GPU instance group."""
    import shutil

    folder = root / "simple"
    shutil.copytree(demo / "simple", folder)
    config = folder / "config.pbtxt"
    config.write_text(config.read_text() + f"instance_group [ {{ kind: KIND_GPU {gpus} }} ]\n")
    return folder


def test_a_kind_gpu_config_loads_on_the_gpu_unless_told_otherwise(demo: Path, tmp_path: Path) -> None:
    import onnxruntime as ort

    folder = _simple_on_gpu(demo, tmp_path, "gpus: [ 0 ]")
    if "CUDAExecutionProvider" in ort.get_available_providers():
        with kiln.load(folder) as engine:
            assert isinstance(engine, OnnxRuntimeEngine) and "CUDAExecutionProvider" in engine.providers
    else:
        # The config's KIND_GPU reaches the engine: this onnxruntime has no CUDA provider, and says so.
        with pytest.raises(UnavailableError, match="a GPU instance was requested"):
            kiln.load(folder)
    with kiln.load(folder, kind="cpu") as engine:  # an explicit option wins over the config
        out = engine.infer({"INPUT0": _ints(), "INPUT1": _ints()})
        np.testing.assert_array_equal(out["OUTPUT0"], 2 * _ints())


def test_config_engine_options_follow_the_first_instance_group(demo: Path, tmp_path: Path) -> None:
    from kiln.config.model_dir import open_model_dir
    from kiln.direct import config_engine_options

    assert config_engine_options(open_model_dir(demo / "simple").spec).kind == "cpu"
    options = config_engine_options(open_model_dir(_simple_on_gpu(demo, tmp_path, "gpus: [ 1, 0 ]")).spec)
    assert (options.kind, options.device_id) == ("gpu", 1)
