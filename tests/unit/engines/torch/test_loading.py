"""Recognising model files by their contents, and the errors for files the PyTorch engine cannot serve."""

from __future__ import annotations

import importlib
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import kiln
from kiln.config import open_model_dir
from kiln.config.spec import ModelSpec
from kiln.engines import EngineOptions
from kiln.engines.torch.loading import ModelFormat, detect_format
from kiln.errors import ConfigError, UnavailableError

from ._models import TWO_HEADS_IO, config, save_torchscript, write_model_folder


def spec_for(tmp_path: Path, platform: str, filename: str = "") -> ModelSpec:
    extra = f'default_model_filename: "{filename}"' if filename else ""
    folder = tmp_path / "spec" / "m"
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(config(platform, *TWO_HEADS_IO, extra=extra))
    return open_model_dir(folder).spec


def load_message(tmp_path: Path, source: Path, platform: str, filename: str = "") -> str:
    extra = f'default_model_filename: "{filename}"' if filename else ""
    folder = write_model_folder(tmp_path, "m", config(platform, *TWO_HEADS_IO, extra=extra), source)
    with pytest.raises(ConfigError) as info:
        kiln.load(folder)
    return str(info.value)


def write_zip(path: Path, entries: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return path


def test_formats_are_read_from_the_archive_listing(tmp_path: Path, files: dict[str, Path]) -> None:
    pt, pt2 = spec_for(tmp_path, "pytorch_libtorch"), spec_for(tmp_path, "torch_aoti")
    assert detect_format(pt, files["script"]) is ModelFormat.TORCHSCRIPT
    assert detect_format(pt, files["trace"]) is ModelFormat.TORCHSCRIPT
    assert detect_format(pt2, files["export"]) is ModelFormat.EXPORTED_PROGRAM
    aoti = write_zip(tmp_path / "aoti.pt2", {"pkg/archive_format": b"pt2", "pkg/data/aotinductor/model/m.so": b""})
    assert detect_format(pt2, aoti) is ModelFormat.AOTI
    legacy = write_zip(tmp_path / "legacy.pt2", {"serialized_exported_program.json": b"{}"})
    assert detect_format(pt2, legacy) is ModelFormat.EXPORTED_PROGRAM


def test_missing_model_file(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(config("pytorch_libtorch", *TWO_HEADS_IO))
    with pytest.raises(ConfigError) as info:
        kiln.load(folder)
    assert str(info.value) == f"model 'm': model file {folder / '1' / 'model.pt'} does not exist"


def test_a_file_that_is_not_an_archive(tmp_path: Path) -> None:
    source = tmp_path / "model.pt"
    source.write_bytes(b"not a model")
    assert load_message(tmp_path / "repo", source, "pytorch_libtorch") == (
        f"model 'm': {tmp_path / 'repo' / 'm' / '1' / 'model.pt'} is not a zip archive, so it is neither TorchScript "
        f"(torch.jit.save) nor a PT2 archive (torch.export.save, aoti_compile_and_package)")


def test_a_torch_save_checkpoint_is_not_a_program(tmp_path: Path) -> None:
    source = tmp_path / "model.pt"
    torch.save(nn.Linear(2, 2).state_dict(), source)
    message = load_message(tmp_path / "repo", source, "pytorch_libtorch")
    assert message.endswith("is a zip archive but neither TorchScript nor a PT2 archive (a torch.save checkpoint "
                            "holds weights or a pickled module, not a program); save the model with torch.jit.save, "
                            "torch.export.save or aoti_compile_and_package")


def test_platform_must_match_the_file(tmp_path: Path, files: dict[str, Path]) -> None:
    message = load_message(tmp_path / "a", files["export"], "pytorch_libtorch", filename="model.pt2")
    assert message == (f"model 'm': platform is 'pytorch_libtorch', but {tmp_path / 'a' / 'm' / '1' / 'model.pt2'} "
                       f"is an exported program (PT2); set platform: \"torch_aoti\" (and default_model_filename if "
                       f"needed)")
    message = load_message(tmp_path / "b", files["script"], "torch_aoti", filename="model.pt")
    assert message.endswith("is TorchScript; set platform: \"pytorch_libtorch\" (and default_model_filename if "
                            "needed)")


def test_a_broken_archive_names_model_and_file(tmp_path: Path) -> None:
    source = write_zip(tmp_path / "model.pt2", {"pkg/archive_format": b"pt2", "pkg/models/model.json": b"{"})
    message = load_message(tmp_path / "repo", source, "torch_aoti")
    assert message.startswith(f"model 'm': PyTorch cannot load {tmp_path / 'repo' / 'm' / '1' / 'model.pt2'} as an "
                              f"exported program (PT2): ")


class TakesAnInteger(nn.Module):
    def forward(self, x: torch.Tensor, times: int) -> torch.Tensor:
        return x * times


def test_forward_arguments_must_be_tensors(tmp_path: Path) -> None:
    source = save_torchscript(TakesAnInteger(), tmp_path / "model.pt")
    assert load_message(tmp_path / "repo", source, "pytorch_libtorch") == (
        "model 'm': forward() argument 'times' has type int; kiln passes tensors only (Tensor, Optional[Tensor], or "
        "one Dict[str, Tensor] argument)")


def test_without_torch_a_pytorch_model_is_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch is an optional extra: kiln.engines.torch still imports, and loading says what to install."""
    import kiln.engines

    monkeypatch.setattr(kiln.engines, "torch", kiln.engines.torch, raising=False)  # the import below rebinds it
    for name in [n for n in sys.modules if n == "kiln.engines.torch" or n.startswith("kiln.engines.torch.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now fails as if it were not installed
    package = importlib.import_module("kiln.engines.torch")
    with pytest.raises(UnavailableError) as info:
        package.TorchEngine(spec_for(tmp_path, "pytorch_libtorch"), tmp_path / "model.pt", EngineOptions())
    assert str(info.value) == ("model 'm': the pytorch backend needs PyTorch, which is not installed here; install "
                               "it with pip install 'kiln[torch]'")
