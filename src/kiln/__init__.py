"""kiln: deploy neural-network inference directly in-process or behind a Triton-compatible server.

The public API: :func:`load` a model into an :class:`Engine` and call ``engine.infer({name: array})``.
"""

from kiln import errors
from kiln.direct import load
from kiln.engines.base import Engine, EngineOptions
from kiln.errors import ErrorCode, KilnError
from kiln.tensor import DataType

__version__ = "0.1.0"

__all__ = ["DataType", "Engine", "EngineOptions", "ErrorCode", "KilnError", "__version__", "errors", "load"]
