"""Explicit loads that bring their own files (``file:<version>/<name>`` parameters) or a config override.

Files are written into a fresh staging folder under the model's own folder (``<model>/.kiln-staging/<unique>/``,
ignored by repository scans), never anywhere else: names that are absolute, contain ``..``, backslashes or NUL,
or resolve outside the staging folder are rejected before anything is written.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from google.protobuf import json_format

from kiln.config.parse import CONFIG_FILENAME, config_to_text
from kiln.errors import InvalidArgumentError
from kiln.v2._generated import model_config_pb2 as pb

STAGING_FOLDER = ".kiln-staging"


def check_model_name(name: str) -> None:
    """A model name is one path component inside the repository."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\0") or name.startswith("."):
        raise InvalidArgumentError(f"invalid model name '{name}': a model name is a single folder name inside the "
                                   f"repository (no '/', '\\\\', '..', NUL or leading '.')")


def parse_config_override(model: str, text: str) -> pb.ModelConfig:
    """The load API's ``config`` parameter: a ModelConfig as JSON (the same form GET .../config returns)."""
    config = pb.ModelConfig()
    try:
        json_format.Parse(text, config)
    except json_format.ParseError as exc:
        raise InvalidArgumentError(f"failed to load '{model}': the 'config' parameter is not a valid model "
                                   f"configuration in JSON: {exc}") from None
    return config


def safe_relative_path(model: str, key: str) -> PurePosixPath:
    """``1/model.onnx`` from a ``file:1/model.onnx`` parameter; anything that could escape is rejected."""
    raw = key[len("file:"):]
    relative = PurePosixPath(raw)
    parts = relative.parts
    if (not raw or relative.is_absolute() or "\\" in raw or "\0" in raw or not parts
            or any(part in ("", ".", "..") for part in parts) or raw.startswith("/")):
        raise InvalidArgumentError(f"failed to load '{model}': file parameter '{key}' must name a file inside the "
                                   f"model folder as file:<version>/<name> (no absolute paths, '..' or '\\\\')")
    if not parts[0].isascii() or not parts[0].isdigit() or len(parts) < 2:
        raise InvalidArgumentError(f"failed to load '{model}': file parameter '{key}' must start with a numeric "
                                   f"version folder, e.g. file:1/model.onnx")
    return relative


def stage_files(model_path: Path, model: str, config: pb.ModelConfig | None, files: Mapping[str, bytes]) -> Path:
    """Write the given files (and the config) into a new staging folder named after the model; return it."""
    relatives = {safe_relative_path(model, key): data for key, data in files.items()}
    staging_root = model_path / STAGING_FOLDER
    if staging_root.is_symlink():
        raise InvalidArgumentError(f"failed to load '{model}': {staging_root} is a symbolic link; remove it")
    staging_root.mkdir(exist_ok=True)
    # A fresh folder per load (unique across processes sharing the repository), never one that exists.
    staging = Path(tempfile.mkdtemp(dir=staging_root)) / model
    staging.mkdir()
    resolved_root = staging.resolve()
    for relative, data in relatives.items():
        target = (staging / relative).resolve()
        if resolved_root not in target.parents:
            raise InvalidArgumentError(f"failed to load '{model}': file '{relative}' would be written outside "
                                       f"the model folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    if config is not None:
        (staging / CONFIG_FILENAME).write_text(config_to_text(config))
    elif (model_path / CONFIG_FILENAME).is_file():
        shutil.copyfile(model_path / CONFIG_FILENAME, staging / CONFIG_FILENAME)
    return staging
