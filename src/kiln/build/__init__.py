"""kiln build: turn a model into an optimized, verified engine folder ready to load or serve.

Names load on first use, so importing one builder (``kiln.build.tensorrt``, ``kiln.build.torch_convert``) never
pulls in the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.build.builder import BuildOptions, build
    from kiln.build.report import BuildReport, VerificationError

__all__ = ["BuildOptions", "BuildReport", "VerificationError", "build"]

_HOMES = {"BuildOptions": "kiln.build.builder", "build": "kiln.build.builder", "BuildReport": "kiln.build.report",
          "VerificationError": "kiln.build.report"}


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kiln.build' has no attribute '{name}'")
    return getattr(importlib.import_module(home), name)
