"""Stands in for TorchEngine where torch is not installed (it is the optional extra ``kiln[torch]``): loading a
PyTorch model then fails with UNAVAILABLE and the install command, instead of an ImportError."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

from kiln.config.spec import ModelSpec
from kiln.engines.base import EngineOptions
from kiln.errors import UnavailableError


def TorchEngine(spec: ModelSpec, model_file: Path, options: EngineOptions) -> NoReturn:
    raise UnavailableError(f"model '{spec.name}': the pytorch backend needs PyTorch, which is not installed here; "
                           f"install it with pip install 'kiln[torch]'")
