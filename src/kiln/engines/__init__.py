"""Engines: a loaded model that runs batches in-process, found by backend name."""

from kiln.engines.base import Engine, EngineOptions, backend_names, create_engine, register_backend

__all__ = ["Engine", "EngineOptions", "backend_names", "create_engine", "register_backend"]
