"""kiln: deploy neural-network inference directly in-process or behind a Triton-compatible server.

The public API: :func:`load` a model into an :class:`Engine` and call ``engine.infer({name: array})``; or run the
protocol-free :class:`Server` over a model repository (what ``kiln serve`` puts behind HTTP and gRPC).
"""

import os
from typing import TYPE_CHECKING

# ONNX Runtime 1.29+ sends usage telemetry to Microsoft from Linux too, read once when it initializes. A server
# should not reach out on its users' behalf unasked: off unless the user set the variable (docs/security.md).
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")  # before any kiln module can import onnxruntime

from kiln import errors
from kiln.direct import load
from kiln.engines.base import Engine, EngineOptions
from kiln.errors import ErrorCode, KilnError
from kiln.tensor import DataType

if TYPE_CHECKING:  # loaded on first use at run time (see __getattr__)
    from kiln.server.server import Server, ServerOptions

__version__ = "0.1.0"

__all__ = ["DataType", "Engine", "EngineOptions", "ErrorCode", "KilnError", "Server", "ServerOptions", "__version__",
           "build", "errors", "load"]


def __getattr__(name: str) -> object:
    # The server core loads on first use, so `import kiln` stays light for direct (edge) use.
    if name == "build":  # the builder loads on first use too; the package itself is callable: kiln.build(...)
        import importlib

        return importlib.import_module("kiln.build")
    if name in ("Server", "ServerOptions"):
        from kiln.server import server

        return getattr(server, name)
    raise AttributeError(f"module 'kiln' has no attribute '{name}'")
