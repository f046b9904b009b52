"""kiln build: turn a model into an optimized, verified engine folder ready to load or serve.

``kiln.build(model, output, precision="int8", ...)`` is the Python form of ``kiln build``: the package itself is
callable. Names load on first use, so importing one builder (``kiln.build.tensorrt``,
``kiln.build.torch_convert``) never pulls in the others.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

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


class _CallableModule(types.ModuleType):
    """``kiln.build(...)`` calls :func:`kiln.build.builder.build`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return importlib.import_module("kiln.build.builder").build(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
