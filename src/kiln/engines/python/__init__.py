"""The Python backend: runs a model.py in-process, written against Triton's Python-backend API or kiln's own."""

from kiln.engines.python.api import Request
from kiln.engines.python.engine import PythonEngine

__all__ = ["PythonEngine", "Request"]
