"""One model folder of a repository: ``<model>/[config.pbtxt]`` and numbered version folders."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kiln.config.autocomplete import DEFAULT_MAX_BATCH_SIZE, complete_from_file, normalize
from kiln.config.backend_autocomplete import complete_with_backend, has_config_completer
from kiln.config.backends import FILE_BACKENDS
from kiln.config.onnx_io import FileIO, read_onnx_io
from kiln.config.parse import CONFIG_FILENAME, read_config
from kiln.config.spec import ModelSpec
from kiln.config.validate import check_file_name, validate_config
from kiln.errors import ConfigError, ModelNotFoundError
from kiln.v2._generated import model_config_pb2 as pb


@dataclass(frozen=True)
class ModelDir:
    """A model folder with its validated spec and the version folders found in it."""

    name: str
    path: Path
    spec: ModelSpec
    versions: dict[int, Path] = field(default_factory=dict)

    def served_versions(self) -> list[int]:
        """Versions the config's version_policy selects, ascending."""
        return select_versions(self.spec.config.version_policy, self.versions)

    def model_file(self, version: int) -> Path:
        folder = self.versions.get(version)
        if folder is None:
            available = ", ".join(str(v) for v in sorted(self.versions)) or "none"
            raise ModelNotFoundError(f"model '{self.name}' has no version {version} (available: {available})")
        return folder / self.spec.config.default_model_filename


def version_folders(model_path: Path) -> dict[int, Path]:
    """Numeric sub-folders; names that are not numeric or start with 0 are ignored, as Triton does."""
    found: dict[int, Path] = {}
    for child in model_path.iterdir():
        if child.is_dir() and child.name.isascii() and child.name.isdigit() and not child.name.startswith("0"):
            found[int(child.name)] = child
    return dict(sorted(found.items()))


def select_versions(policy: pb.ModelVersionPolicy, available: dict[int, Path]) -> list[int]:
    versions = sorted(available)
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return versions
    if choice == "specific":
        return sorted(v for v in set(policy.specific.versions) if v in available)
    count = policy.latest.num_versions if choice == "latest" else 1
    return versions[-count:] if count else []


def open_model_dir(model_path: Path, *, autocomplete: bool = True,
                   default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
                   config: pb.ModelConfig | None = None) -> ModelDir:
    """Read, complete and validate a model folder. ``config`` replaces config.pbtxt when given."""
    model_path = Path(model_path)
    if not model_path.is_dir():
        raise ConfigError(f"{model_path}: not a model folder (expected <model>/<version>/<model file>)")
    name = model_path.name
    config_file = model_path / CONFIG_FILENAME
    source = str(config_file) if config_file.is_file() or config is not None else f"{model_path} (no {CONFIG_FILENAME})"
    if config is None:
        config = read_config(model_path) or pb.ModelConfig()
    else:
        config = _copy(config)
    versions = version_folders(model_path)
    if not versions:
        raise ConfigError(f"{model_path}: no version folder; put the model file in a numbered folder, "
                          f"e.g. {model_path / '1'}")
    if not config.backend and not config.platform:
        _infer_backend(config, versions)
    normalize(config, name, source)
    check_file_name(config.default_model_filename, "default_model_filename", source)  # before anything is read
    file_io = _file_io(config, versions, model_path)
    if file_io is not None and autocomplete:
        complete_from_file(config, file_io, default_max_batch_size)
    if autocomplete and has_config_completer(config.backend):
        complete_with_backend(config, _newest_model_file(config, versions, model_path))
    spec = validate_config(config, name, source, file_io)
    return ModelDir(name=name, path=model_path, spec=spec, versions=versions)


def _copy(config: pb.ModelConfig) -> pb.ModelConfig:
    copy = pb.ModelConfig()
    copy.CopyFrom(config)
    return copy


def _infer_backend(config: pb.ModelConfig, versions: dict[int, Path]) -> None:
    for folder in reversed(list(versions.values())):
        for filename, backend, platform in FILE_BACKENDS:
            if (folder / filename).exists():
                config.backend, config.platform = backend, platform
                return


def _file_io(config: pb.ModelConfig, versions: dict[int, Path], model_path: Path) -> FileIO | None:
    """The tensors the newest served version's file declares (ONNX only; other backends describe themselves)."""
    if config.backend != "onnxruntime":
        return None
    return read_onnx_io(_newest_model_file(config, versions, model_path))


def _newest_model_file(config: pb.ModelConfig, versions: dict[int, Path], model_path: Path) -> Path:
    served = select_versions(config.version_policy, versions) or sorted(versions)
    model_file = versions[served[-1]] / config.default_model_filename
    if not model_file.exists():
        raise ConfigError(f"{model_path}: version {served[-1]} has no {config.default_model_filename}; "
                          f"expected {model_file}")
    return model_file
