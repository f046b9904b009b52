"""Model configuration: config.pbtxt parsing, auto-complete, validation and Triton-style JSON rendering."""

from kiln.config.model_dir import ModelDir, open_model_dir, select_versions, version_folders
from kiln.config.parse import parse_config_text, read_config
from kiln.config.render import config_to_json
from kiln.config.spec import ModelSpec, TensorSpec

__all__ = [
    "ModelDir",
    "ModelSpec",
    "TensorSpec",
    "config_to_json",
    "open_model_dir",
    "parse_config_text",
    "read_config",
    "select_versions",
    "version_folders",
]
