"""Tiny torch models built in code, saved as TorchScript (model.pt) or PT2 (model.pt2), and the config.pbtxt
that serves them. Weights are random but seeded, so an eager run of the same module is the reference."""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

Tensor = torch.Tensor
_RNG = np.random.default_rng(7)
X = _RNG.standard_normal((3, 4)).astype(np.float32)  # TwoHeads' inputs, batch of 3
Y = _RNG.standard_normal((3, 3)).astype(np.float32)
TensorDecl = tuple[str, str, Sequence[int]]  # (name, TYPE_*, dims)


class TwoHeads(nn.Module):
    """Two inputs, two outputs: ``(linear(x) + y, relu(linear(x)) * 2)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 3)

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        hidden = self.linear(x)
        return hidden + y, torch.relu(hidden) * 2


class DictHeads(nn.Module):
    """Returns a dict, matched to the config's outputs by key."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.linear = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"scores": self.linear(x), "doubled": x * 2}


class Difference(nn.Module):
    """Takes one Dict[str, Tensor] argument, as Triton's PyTorch backend allows for TorchScript."""

    def forward(self, inputs: dict[str, Tensor]) -> Tensor:
        return inputs["a"] - inputs["b"]


class ConvNet(nn.Module):
    """A 4-D image input: conv, ReLU, global average pool, linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, image: Tensor) -> Tensor:
        features = torch.relu(self.conv(image))
        return self.head(features.mean(dim=(2, 3)))


class Counter(nn.Module):
    """Integer in, integer out: ``x + 1`` (int64) and ``x > 2`` (bool)."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x + 1, x > 2


def save_torchscript(module: nn.Module, path: Path, example: tuple[Tensor, ...] | None = None) -> Path:
    """torch.jit.script, or torch.jit.trace when ``example`` inputs are given, then torch.jit.save."""
    with warnings.catch_warnings():
        # torch 2.13 deprecates torch.jit.script and trace (which warns again from trace_method) in favour of
        # torch.export; TorchScript is still a format the backend serves (Triton's pytorch_libtorch), so the
        # tests keep producing it.
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.(script|trace|trace_method)` is deprecated",
                                category=DeprecationWarning)
        scripted = torch.jit.script(module.eval()) if example is None else torch.jit.trace(module.eval(), example)
    path.parent.mkdir(parents=True, exist_ok=True)
    scripted.save(str(path))
    return path


def save_exported(module: nn.Module, example: tuple[Tensor, ...], path: Path, batch: bool = True) -> Path:
    """torch.export.export with a dynamic leading (batch) dimension on every input, then torch.export.save."""
    names = list(module.forward.__code__.co_varnames[1:1 + len(example)])
    dynamic = None
    if batch:
        dim = torch.export.Dim("batch", min=1, max=64)
        dynamic = {name: {0: dim} for name in names}
    program = torch.export.export(module.eval(), example, dynamic_shapes=dynamic)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, str(path))
    return path


def require_loadable_aoti(package: Path) -> None:
    """Skip unless this torch loads the AOTInductor package on this machine. Probed in a child process: on some
    machines torch's package loader crashes the process (it did with torch 2.11.0+cu130 on one GPU machine, for
    any package), which would end the whole test run instead of failing one test."""
    code = "import sys; from torch._inductor import aoti_load_package; aoti_load_package(sys.argv[1])"
    probe = subprocess.run([sys.executable, "-c", code, str(package)], capture_output=True, timeout=600)
    if probe.returncode < 0:
        pytest.skip(f"torch {torch.__version__} crashes (signal {-probe.returncode}) loading an AOTInductor package "
                    f"on this machine")


def config(platform: str, inputs: Sequence[TensorDecl], outputs: Sequence[TensorDecl], max_batch_size: int = 8,
           parameters: Mapping[str, str] | None = None, kind: str = "KIND_CPU", extra: str = "") -> str:
    """A complete config.pbtxt (Triton does not auto-complete PyTorch models)."""

    def tensors(entries: Sequence[TensorDecl]) -> str:
        return ", ".join(f'{{ name: "{n}" data_type: {t} dims: [ {", ".join(str(d) for d in dims)} ] }}'
                         for n, t, dims in entries)

    lines = [f'platform: "{platform}"', f"max_batch_size: {max_batch_size}",
             f"input [ {tensors(inputs)} ]", f"output [ {tensors(outputs)} ]",
             f"instance_group [ {{ kind: {kind} count: 1 }} ]"]
    lines += [f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in (parameters or {}).items()]
    return "\n".join(lines + [extra]) + "\n"


def write_model_folder(root: Path, name: str, config_text: str, source: Path, version: int = 1) -> Path:
    """``<root>/<name>/config.pbtxt`` and ``<root>/<name>/<version>/<source's file name>``; returns the folder."""
    folder = root / name
    (folder / str(version)).mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(config_text, encoding="utf-8")
    (folder / str(version) / source.name).write_bytes(source.read_bytes())
    return folder


TWO_HEADS_IO: tuple[list[TensorDecl], list[TensorDecl]] = (
    [("x", "TYPE_FP32", [4]), ("y", "TYPE_FP32", [3])],
    [("OUTPUT__0", "TYPE_FP32", [3]), ("OUTPUT__1", "TYPE_FP32", [3])],
)
