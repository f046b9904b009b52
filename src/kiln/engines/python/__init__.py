"""The Python backend: runs a model.py, written against Triton's Python-backend API or kiln's own, in-process or
(parameter KILN_EXECUTION_ISOLATION: process) in a child process of its own."""

from pathlib import Path

from kiln.config.spec import ModelSpec
from kiln.engines.base import Engine, EngineOptions
from kiln.engines.python.api import Request
from kiln.engines.python.engine import PythonEngine
from kiln.engines.python.isolated import IsolatedPythonEngine, isolated


def python_engine(spec: ModelSpec, model_file: Path, options: EngineOptions) -> Engine:
    """The engine for one instance: isolated in a child process when the model's config asks for it."""
    if isolated(spec):
        return IsolatedPythonEngine(spec, model_file, options)
    return PythonEngine(spec, model_file, options)


__all__ = ["IsolatedPythonEngine", "PythonEngine", "Request", "python_engine"]
