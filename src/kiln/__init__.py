"""kiln: deploy neural-network inference directly in-process or behind a Triton-compatible server.

The public API: :func:`load` a model into an :class:`Engine` and call ``engine.infer({name: array})``; or run the
protocol-free :class:`Server` over a model repository (what ``kiln serve`` puts behind HTTP and gRPC).
"""

from typing import TYPE_CHECKING

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
