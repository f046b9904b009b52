"""Complete a Python model's configuration from its model.py, the way Triton does.

Triton imports model.py while reading the model folder and calls ``TritonPythonModel.auto_complete_config`` with
the configuration so far; what it returns is the configuration the model loads with (inputs, outputs,
max_batch_size, dynamic batching). Running model.py needs the Python backend (its ``triton_python_backend_utils``
module and module loader), which sits above config in kiln's layers: it is looked up by name when a Python model
is read, so importing kiln.config never imports an engine.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from kiln.config._generated import model_config_pb2 as pb
from kiln.config.render import config_to_json
from kiln.errors import ConfigError

_RUNNER = "kiln.engines.python.autocomplete"


def complete_python_config(config: pb.ModelConfig, model_file: Path) -> None:
    """Replace ``config`` with what model.py's ``auto_complete_config`` makes of it (unchanged when it has none)."""
    runner: Any = importlib.import_module(_RUNNER).run_auto_complete
    completed = runner(config_to_json(config), model_file)
    if completed is None:
        return
    result = pb.ModelConfig()
    try:
        json_format.ParseDict(completed, result)
    except (json_format.ParseError, TypeError, ValueError) as exc:
        raise ConfigError(f"model '{config.name}': auto_complete_config in {model_file} produced a configuration "
                          f"that is not a valid ModelConfig: {exc}") from None
    config.CopyFrom(result)
