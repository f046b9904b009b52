"""Auto-complete that only a backend can do: Triton's Python backend asks model.py (``auto_complete_config``).

Running model.py needs the backend itself, which sits above config in kiln's layers. So config only defines the
hook: a backend registers a completer for its name (``kiln.engines`` does so for "python"), and reading a model
folder calls it. Importing kiln.config never imports an engine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from kiln.config.render import config_to_json
from kiln.errors import ConfigError
from kiln.v2._generated import model_config_pb2 as pb

ConfigCompleter = Callable[[dict[str, Any], Path], "dict[str, Any] | None"]
"""(config as Triton JSON, the newest served version's model file) -> the completed JSON, or None: unchanged."""

_COMPLETERS: dict[str, ConfigCompleter] = {}


def register_config_completer(backend: str, completer: ConfigCompleter) -> None:
    _COMPLETERS[backend] = completer


def has_config_completer(backend: str) -> bool:
    return backend in _COMPLETERS


def complete_with_backend(config: pb.ModelConfig, model_file: Path) -> None:
    """Replace ``config`` with what its backend's completer makes of it (unchanged when there is none)."""
    completer = _COMPLETERS.get(config.backend)
    if completer is None:
        return
    completed = completer(config_to_json(config), model_file)
    if completed is None:
        return
    result = pb.ModelConfig()
    try:
        json_format.ParseDict(completed, result)
    except (json_format.ParseError, TypeError, ValueError) as exc:
        raise ConfigError(f"model '{config.name}': auto_complete_config in {model_file} produced a configuration "
                          f"that is not a valid ModelConfig: {exc}") from None
    config.CopyFrom(result)
