"""Fixtures shared by the PyTorch engine tests: every test model saved once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ._models import ConvNet, Counter, DictHeads, Difference, TwoHeads, X, Y, save_exported, save_torchscript


@pytest.fixture(scope="session")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each test model saved once per format."""
    root = tmp_path_factory.mktemp("files")
    example = (torch.from_numpy(X), torch.from_numpy(Y))
    image = torch.zeros(2, 3, 8, 8)
    return {
        "script": save_torchscript(TwoHeads(), root / "script" / "model.pt"),
        "trace": save_torchscript(TwoHeads(), root / "trace" / "model.pt", example),
        "export": save_exported(TwoHeads(), example, root / "export" / "model.pt2"),
        "dict_script": save_torchscript(DictHeads(), root / "dict_script" / "model.pt"),
        "dict_export": save_exported(DictHeads(), (example[0],), root / "dict_export" / "model.pt2"),
        "difference": save_torchscript(Difference(), root / "difference" / "model.pt"),
        "conv_script": save_torchscript(ConvNet(), root / "conv_script" / "model.pt"),
        "conv_export": save_exported(ConvNet(), (image,), root / "conv_export" / "model.pt2"),
        "counter": save_torchscript(Counter(), root / "counter" / "model.pt"),
        "bf16": save_torchscript(TwoHeads().to(torch.bfloat16), root / "bf16" / "model.pt"),
    }


@pytest.fixture
def restore_threads() -> Iterator[None]:
    """torch.set_num_threads is process-wide: put it back after tests that change it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
