"""Read config.pbtxt (protobuf text format) into a ModelConfig message."""

from __future__ import annotations

import re
from pathlib import Path

from google.protobuf import text_format

from kiln.errors import ConfigError
from kiln.v2._generated import model_config_pb2 as pb

CONFIG_FILENAME = "config.pbtxt"

_POSITION = re.compile(r"^(\d+):(\d+) : (.*)$", re.DOTALL)


def parse_config_text(text: str, source: str = CONFIG_FILENAME) -> pb.ModelConfig:
    """Parse config.pbtxt text. Syntax errors name the file, line and column."""
    config = pb.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise ConfigError(_describe_parse_error(str(exc), source)) from None
    except ValueError as exc:  # an enum field given an integer outside int32 ("Value out of range"), no position
        raise ConfigError(f"{source}: syntax error: {exc} (an enum field takes a value name, e.g. TYPE_FP32, or "
                          f"a 32-bit integer)") from None
    return config


def read_config(model_path: Path, filename: str = CONFIG_FILENAME) -> pb.ModelConfig | None:
    """The model folder's config, or None when the folder has no config file (auto-complete fills it in)."""
    path = model_path / filename
    if not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8") from None
    return parse_config_text(text, str(path))


def config_to_text(config: pb.ModelConfig) -> str:
    return text_format.MessageToString(config)


def _describe_parse_error(message: str, source: str) -> str:
    match = _POSITION.match(message)
    if match is None:
        return f"{source}: syntax error: {message}"
    line, column, detail = match.groups()
    hint = _hint(detail)
    return f"{source}: syntax error at line {line}, column {column}: {detail}{hint}"


def _hint(detail: str) -> str:
    if "has no field named" in detail:
        return " (check the spelling against Triton's model_config.proto field names)"
    unknown_enum = "Unknown enumeration value" in detail or "has no value named" in detail
    if unknown_enum and ("data_type" in detail or "inference.DataType" in detail):
        names = ", ".join(name for name in pb.DataType.keys() if name != "TYPE_INVALID")
        return f" (valid data_type values: {names})"
    if unknown_enum:
        return " (check the enum value spelling, e.g. KIND_CPU, KIND_GPU)"
    return ""
