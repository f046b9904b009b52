"""Recognise and load the PyTorch backend's model files.

* ``model.pt``: TorchScript (``torch.jit.save``), for platform ``pytorch_libtorch`` (or ``libtorch``).
* ``model.pt2``: a PT2 archive, for platform ``torch_aoti``. It holds either an AOTInductor package
  (``torch._inductor.aoti_compile_and_package``: compiled kernels under ``data/aotinductor/``) or an exported program
  (``torch.export.save``: a graph under ``models/``). The archive's listing says which; nothing is loaded on trial.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import json
import threading
import warnings
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.config.spec import ModelSpec
from kiln.errors import ConfigError

# The PT2 archive layout (torch.export.pt2_archive.constants): "<root>/archive_format" holds b"pt2".
_ARCHIVE_FORMAT = "archive_format"
_AOTI_DIR = "data/aotinductor/"
_MODELS_DIR = "models/"
# torch.export.save before the PT2 archive (torch < 2.6) wrote this file instead.
_LEGACY_PROGRAM = "serialized_exported_program.json"

_PLATFORM_FORMATS = {"pytorch_libtorch": "torchscript", "libtorch": "torchscript", "torch_aoti": "pt2"}
# catch_warnings() swaps process-wide filters, so loads that silence a warning take turns.
_WARNINGS_LOCK = threading.Lock()


class ModelFormat(enum.Enum):
    TORCHSCRIPT = "torchscript"
    EXPORTED_PROGRAM = "exported_program"
    AOTI = "aoti"


@dataclass
class LoadedModel:
    """What the engine calls, and what the file says about its arguments."""

    format: ModelFormat
    function: Callable[..., Any]
    module: torch.nn.Module | None  # castable (dtype, memory format) and compilable; None for AOTInductor
    arg_names: tuple[str, ...] | None  # forward()'s argument names where the file records them
    required_args: int | None  # arguments without a default, where known
    dict_input: bool = False  # TorchScript forward(self, inputs: Dict[str, Tensor])
    device_key: str = ""  # the device an AOTInductor package was compiled for ("cpu", "cuda")


def detect_format(spec: ModelSpec, path: Path) -> ModelFormat:
    """The model file's format, read from its zip listing; ConfigError when it is not one kiln loads or when it
    does not match the config's platform."""
    if not path.is_file():
        raise ConfigError(f"model '{spec.name}': model file {path} does not exist")
    try:
        with zipfile.ZipFile(path) as archive:
            found = _format_of(archive)
    except zipfile.BadZipFile:
        raise ConfigError(f"model '{spec.name}': {path} is not a zip archive, so it is neither TorchScript "
                          f"(torch.jit.save) nor a PT2 archive (torch.export.save, aoti_compile_and_package)") from None
    if found is None:
        raise ConfigError(f"model '{spec.name}': {path} is a zip archive but neither TorchScript nor a PT2 archive "
                          f"(a torch.save checkpoint holds weights or a pickled module, not a program); save the "
                          f"model with torch.jit.save, torch.export.save or aoti_compile_and_package")
    expected = _PLATFORM_FORMATS.get(spec.platform, "")
    actual = "torchscript" if found is ModelFormat.TORCHSCRIPT else "pt2"
    if expected and expected != actual:
        hint = "torch_aoti" if actual == "pt2" else "pytorch_libtorch"
        raise ConfigError(f"model '{spec.name}': platform is '{spec.platform}', but {path} is "
                          f"{_describe(found)}; set platform: \"{hint}\" (and default_model_filename if needed)")
    return found


def _format_of(archive: zipfile.ZipFile) -> ModelFormat | None:
    names = archive.namelist()
    roots = sorted({name.split("/", 1)[0] for name in names if "/" in name})
    for root in roots:
        marker = f"{root}/{_ARCHIVE_FORMAT}"
        if marker in names and archive.read(marker).strip() == b"pt2":
            if any(name.startswith(f"{root}/{_AOTI_DIR}") for name in names):
                return ModelFormat.AOTI
            if any(name.startswith(f"{root}/{_MODELS_DIR}") and name.endswith(".json") for name in names):
                return ModelFormat.EXPORTED_PROGRAM
    if any(name.endswith(f"/{_LEGACY_PROGRAM}") or name == _LEGACY_PROGRAM for name in names):
        return ModelFormat.EXPORTED_PROGRAM
    if any(name.endswith("/constants.pkl") for name in names) and any("/code/" in name for name in names):
        return ModelFormat.TORCHSCRIPT
    return None


def _describe(found: ModelFormat) -> str:
    return {ModelFormat.TORCHSCRIPT: "TorchScript", ModelFormat.EXPORTED_PROGRAM: "an exported program (PT2)",
            ModelFormat.AOTI: "an AOTInductor package (PT2)"}[found]


def load_model(spec: ModelSpec, path: Path, found: ModelFormat, device: torch.device,
               single_threaded: bool = False) -> LoadedModel:
    """Load ``path`` onto ``device``. ``single_threaded`` runs an AOTInductor package without its own locking,
    which CUDA graph capture needs (the caller then serializes runs)."""
    loaders = {ModelFormat.TORCHSCRIPT: _load_torchscript, ModelFormat.EXPORTED_PROGRAM: _load_exported}
    try:
        if found is ModelFormat.AOTI:
            return _load_aoti(path, device, single_threaded)
        return loaders[found](spec, path, device)
    except ConfigError:
        raise
    except Exception as exc:  # torch raises RuntimeError, ValueError, pickling and zip errors for broken files
        raise ConfigError(f"model '{spec.name}': PyTorch cannot load {path} as {_describe(found)}: {exc}") from None


def _load_torchscript(spec: ModelSpec, path: Path, device: torch.device) -> LoadedModel:
    # torch 2.13 warns "`torch.jit.load` is deprecated" on every load. TorchScript is the format of Triton's
    # pytorch_libtorch platform, so kiln loads it on purpose; the warning says nothing about this model.
    with ignoring(r"`torch\.jit\.load` is deprecated", DeprecationWarning):
        module = torch.jit.load(str(path), map_location=device)  # type: ignore[no-untyped-call]  # unannotated
    module.eval()
    arguments = list(module.forward.schema.arguments)
    if arguments and arguments[0].name == "self":
        arguments = arguments[1:]
    kinds = [str(argument.type.kind()) for argument in arguments]
    if len(arguments) == 1 and kinds[0] == "DictType":
        return LoadedModel(ModelFormat.TORCHSCRIPT, module, module, None, None, dict_input=True)
    for argument, kind in zip(arguments, kinds, strict=True):
        if kind not in ("TensorType", "OptionalType"):
            raise ConfigError(f"model '{spec.name}': forward() argument '{argument.name}' has type "
                              f"{argument.type}; kiln passes tensors only (Tensor, Optional[Tensor], or one "
                              f"Dict[str, Tensor] argument)")
    names = tuple(argument.name for argument in arguments)
    required = sum(1 for argument in arguments if not argument.has_default_value())
    return LoadedModel(ModelFormat.TORCHSCRIPT, module, module, names, required)


def _load_exported(spec: ModelSpec, path: Path, device: torch.device) -> LoadedModel:
    # torch 2.11 warns once that "the given buffer is not writable" from a torch.frombuffer call inside
    # torch.export.load, over the archive's own weight bytes: nothing the caller can act on.
    with ignoring(r"The given buffer is not writable", UserWarning):
        program = torch.export.load(str(path))
    if device.type != "cpu":
        # Moves constants baked into the graph too, which module.to(device) would miss.
        from torch.export.passes import move_to_device_pass

        program = move_to_device_pass(program, device)
    module = program.module()
    parameters = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = tuple(p.name for p in parameters) or None
    required = sum(1 for p in parameters if p.default is p.empty) if names else None
    return LoadedModel(ModelFormat.EXPORTED_PROGRAM, module, module, names, required)


def _load_aoti(path: Path, device: torch.device, single_threaded: bool) -> LoadedModel:
    from torch._inductor import aoti_load_package

    index = device.index if device.type == "cuda" and device.index is not None else -1
    compiled = aoti_load_package(str(path), run_single_threaded=single_threaded, device_index=index)
    metadata = compiled.get_metadata()
    arity = _aoti_arity(compiled.loader.get_call_spec()[0])
    return LoadedModel(ModelFormat.AOTI, compiled, None, None, arity,
                       device_key=str(metadata.get("AOTI_DEVICE_KEY", "")))


@contextlib.contextmanager
def ignoring(message: str, category: type[Warning]) -> Iterator[None]:
    """Silence one known, harmless torch warning around a call (matched by message and category)."""
    with _WARNINGS_LOCK, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=message, category=category)
        yield


def _aoti_arity(in_spec: str) -> int | None:
    """Positional arguments in an AOTInductor call spec: ``[1, {tuple: [args tuple, kwargs dict]}]`` as JSON."""
    try:
        root = json.loads(in_spec)[1]
        return len(root["children_spec"][0]["children_spec"])
    except (ValueError, LookupError, TypeError):
        return None
