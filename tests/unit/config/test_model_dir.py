"""A model folder: version folders, version policy, backend inference from files, and the errors on bad layouts."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from kiln.config import ModelDir, open_model_dir, select_versions, version_folders
from kiln.config.parse import parse_config_text
from kiln.errors import ConfigError, ModelNotFoundError
from kiln.testing import make_repo, onnx_add_sub_model, onnx_identity_model, write_model
from kiln.v2._generated import model_config_pb2 as pb

IO = ('input [ { name: "I" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
      'output [ { name: "O" data_type: TYPE_FP32 dims: [ 1 ] } ]\n')


def _mkdirs(root: Path, *names: str) -> Path:
    for name in names:
        (root / name).mkdir(parents=True)
    return root


# -- version folders


def test_version_folders_numeric_only(tmp_path: Path) -> None:
    _mkdirs(tmp_path, "1", "3", "12", "0", "01", "007", "v2", "2a", "-4", " 5", ".9", "latest")
    (tmp_path / "7").write_bytes(b"")  # a file, not a folder
    found = version_folders(tmp_path)
    assert list(found) == [1, 3, 12]  # ascending
    assert found[12] == tmp_path / "12"


def test_version_folders_empty(tmp_path: Path) -> None:
    assert version_folders(tmp_path) == {}


def test_version_folders_ignore_non_ascii_digits(tmp_path: Path) -> None:
    _mkdirs(tmp_path, "1", "²")
    assert list(version_folders(tmp_path)) == [1]


def test_version_folders_ignore_non_ascii_numbers(tmp_path: Path) -> None:
    _mkdirs(tmp_path, "١")
    assert version_folders(tmp_path) == {}


# -- version policy


def _policy(text: str) -> pb.ModelVersionPolicy:
    return parse_config_text(f"version_policy: {{ {text} }}").version_policy


AVAILABLE = {1: Path("1"), 2: Path("2"), 5: Path("5")}


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (pb.ModelVersionPolicy(), [5]),  # unset: Triton's default, latest 1
        (_policy("latest: { num_versions: 1 }"), [5]),
        (_policy("latest: { num_versions: 2 }"), [2, 5]),
        (_policy("latest: { num_versions: 9 }"), [1, 2, 5]),
        (_policy("all: { }"), [1, 2, 5]),
        (_policy("specific: { versions: [ 5, 1 ] }"), [1, 5]),
        (_policy("specific: { versions: [ 1, 3, 9 ] }"), [1]),  # versions not present are skipped
        (_policy("specific: { versions: [ 2, 2 ] }"), [2]),
        (_policy("specific: { versions: [ 7 ] }"), []),
    ],
)
def test_select_versions(policy: pb.ModelVersionPolicy, expected: list[int]) -> None:
    assert select_versions(policy, AVAILABLE) == expected


def test_select_versions_none_available() -> None:
    assert select_versions(_policy("all: { }"), {}) == []
    assert select_versions(_policy("latest: { num_versions: 3 }"), {}) == []


def test_served_versions(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", onnx_add_sub_model(), "version_policy: { latest: { num_versions: 2 } }",
                         versions=(1, 2, 10))
    model_dir = open_model_dir(folder)
    assert isinstance(model_dir, ModelDir)
    assert (model_dir.name, model_dir.path) == ("m", folder)
    assert list(model_dir.versions) == [1, 2, 10]
    assert model_dir.served_versions() == [2, 10]
    assert model_dir.model_file(2) == folder / "2" / "model.onnx"


def test_model_file_missing_version(tmp_path: Path) -> None:
    model_dir = open_model_dir(write_model(tmp_path, "m", onnx_add_sub_model(), versions=(1, 3)))
    with pytest.raises(ModelNotFoundError) as info:
        model_dir.model_file(2)
    assert str(info.value) == "model 'm' has no version 2 (available: 1, 3)"


def test_file_io_comes_from_the_newest_served_version(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", onnx_add_sub_model(), "version_policy: { specific: { versions: [ 1 ] } }")
    write_model(tmp_path, "m", onnx_identity_model(), versions=(2,))
    spec = open_model_dir(folder).spec
    assert [t.name for t in spec.inputs] == ["INPUT0", "INPUT1"]  # version 1's file, not version 2's


def test_file_io_falls_back_to_the_newest_version(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", onnx_add_sub_model(), "version_policy: { specific: { versions: [ 7 ] } }")
    write_model(tmp_path, "m", onnx_identity_model(), versions=(2,))
    model_dir = open_model_dir(folder)
    assert [t.name for t in model_dir.spec.inputs] == ["INPUT0"]
    assert model_dir.served_versions() == []


# -- backend and model file


@pytest.mark.parametrize(
    ("filename", "backend", "platform", "default"),
    [
        ("model.onnx", "onnxruntime", "onnxruntime_onnx", "model.onnx"),
        ("model.py", "python", "", "model.py"),
        ("model.plan", "tensorrt", "tensorrt_plan", "model.plan"),
        ("model.pt", "pytorch", "pytorch_libtorch", "model.pt"),
        ("model.pt2", "pytorch", "torch_aoti", "model.pt2"),
    ],
)
def test_backend_inferred_from_files(tmp_path: Path, filename: str, backend: str, platform: str,
                                     default: str) -> None:
    if filename == "model.onnx":
        folder = write_model(tmp_path, "m", onnx_add_sub_model())
    else:
        folder = write_model(tmp_path, "m", None, IO)
        (folder / "1" / filename).write_bytes(b"")
    model_dir = open_model_dir(folder)
    config = model_dir.spec.config
    assert (config.backend, config.platform, config.default_model_filename) == (backend, platform, default)
    assert model_dir.model_file(1) == folder / "1" / default


def test_explicit_backend_wins_over_files(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", None, 'backend: "python"\n' + IO)
    (folder / "1" / "model.onnx").write_bytes(b"not onnx")
    (folder / "1" / "model.py").write_text("")
    assert open_model_dir(folder).spec.backend == "python"


def test_default_model_filename(tmp_path: Path) -> None:
    text = 'backend: "onnxruntime"\ndefault_model_filename: "net.onnx"\nmax_batch_size: 2'
    folder = write_model(tmp_path, "m", onnx_add_sub_model(), text, filename="net.onnx")
    model_dir = open_model_dir(folder)
    assert model_dir.model_file(1) == folder / "1" / "net.onnx"
    assert [t.name for t in model_dir.spec.inputs] == ["INPUT0", "INPUT1"]  # read from net.onnx


def test_model_onnx_may_be_a_folder(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", None)
    (folder / "1" / "model.onnx").mkdir()
    onnx.save(onnx_add_sub_model(), str(folder / "1" / "model.onnx" / "model.onnx"))
    model_dir = open_model_dir(folder)
    assert model_dir.spec.backend == "onnxruntime"
    assert [t.name for t in model_dir.spec.outputs] == ["OUTPUT0", "OUTPUT1"]
    assert model_dir.model_file(1) == folder / "1" / "model.onnx"


def test_not_a_folder(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    for path in (tmp_path / "file", tmp_path / "missing"):
        with pytest.raises(ConfigError) as info:
            open_model_dir(path)
        assert str(info.value) == f"{path}: not a model folder (expected <model>/<version>/<model file>)"


def test_missing_version_folder(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    _mkdirs(folder, "0", "v1")
    (folder / "config.pbtxt").write_text('backend: "onnxruntime"')
    with pytest.raises(ConfigError) as info:
        open_model_dir(folder)
    assert str(info.value) == (f"{folder}: no version folder; put the model file in a numbered folder, "
                               f"e.g. {folder / '1'}")


def test_missing_model_file(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", None, 'backend: "onnxruntime"', versions=(1, 2))
    with pytest.raises(ConfigError) as info:
        open_model_dir(folder)
    assert str(info.value) == f"{folder}: version 2 has no model.onnx; expected {folder / '2' / 'model.onnx'}"


def test_missing_model_file_no_config(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", None)
    (folder / "1" / "weights.bin").write_bytes(b"")
    with pytest.raises(ConfigError) as info:
        open_model_dir(folder)
    message = str(info.value)
    assert message.startswith(f"{folder} (no config.pbtxt): no backend or platform given")
    assert 'set backend: "onnxruntime"' in message


def test_unreadable_onnx_file(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", None, 'backend: "onnxruntime"')
    (folder / "1" / "model.onnx").write_bytes(b"\x08\x01garbage-not-a-model")
    with pytest.raises(ConfigError) as info:
        open_model_dir(folder)
    assert str(info.value).startswith(f"{folder / '1' / 'model.onnx'}: cannot read the ONNX model (")


def test_config_override_replaces_config_pbtxt(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", onnx_add_sub_model(), "max_batch_size: 2")
    override = parse_config_text("max_batch_size: 16\ninstance_group [ { count: 3 } ]")
    pristine = override.SerializeToString()
    model_dir = open_model_dir(folder, config=override)
    assert model_dir.spec.max_batch_size == 16
    assert model_dir.spec.config.instance_group[0].count == 3
    assert override.SerializeToString() == pristine  # the caller's message is not modified
    assert open_model_dir(folder).spec.max_batch_size == 2  # the file itself is untouched


def test_config_override_without_config_file(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", onnx_add_sub_model())
    model_dir = open_model_dir(folder, config=parse_config_text("max_batch_size: 3"))
    assert model_dir.spec.max_batch_size == 3


def test_config_override_is_validated(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", onnx_add_sub_model())
    with pytest.raises(ConfigError, match="max_batch_size is -3; expected 0 \\(no batching\\) or more"):
        open_model_dir(folder, config=parse_config_text("max_batch_size: -3"))


def test_make_repo_lays_out_several_models(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "repo", a=onnx_add_sub_model(), b=(onnx_identity_model(), "max_batch_size: 2"))
    assert sorted(p.name for p in root.iterdir()) == ["a", "b"]
    assert not (root / "a" / "config.pbtxt").exists()
    assert (root / "b" / "config.pbtxt").read_text() == "max_batch_size: 2"
    assert open_model_dir(root / "a").spec.max_batch_size == 4
    assert open_model_dir(root / "b").spec.max_batch_size == 2
