"""Run a Python model's ``auto_complete_config`` on its configuration, as Triton does while loading the model.

model.py is imported under a throwaway name for the call and forgotten afterwards, so nothing created here
reaches the instances (Triton destroys the interpreter it used for the same reason).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.engines.python.loader import import_model_file, model_classes
from kiln.engines.python.model_config import ModelConfig
from kiln.errors import ConfigError, KilnError


def run_auto_complete(config: dict[str, Any], model_file: Path) -> dict[str, Any] | None:
    """The completed configuration, or None when no model class has ``auto_complete_config`` (a model.py
    without a model class is reported when an instance loads it)."""
    name = str(config.get("name", model_file.parent.parent.name))
    module = import_model_file(name, model_file)
    try:
        hooks = [getattr(cls, "auto_complete_config", None) for cls in model_classes(module.module).values()]
        hook = next((h for h in hooks if h is not None), None)
        if hook is None:
            return None
        try:
            completed = hook(ModelConfig(config))
        except KilnError:
            raise
        except Exception as exc:  # Triton's ModelConfig raises ValueError on conflicts; the user's code anything
            raise ConfigError(f"model '{name}': auto_complete_config in {model_file} raised "
                              f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(completed, ModelConfig):
            raise ConfigError(f"model '{name}': auto_complete_config in {model_file} returned "
                              f"{type(completed).__name__}; it must return the pb_utils.ModelConfig it was given")
        return completed.as_dict()
    finally:
        module.unload()
