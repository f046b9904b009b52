"""Import a model.py so that no two loads share module state, and find its model class.

Each load gets a fresh package (``kiln_python_model_<n>_<model>``) whose search path is the version folder, and
model.py becomes its ``model`` submodule; so relative imports (``from . import helpers``) work and stay private
to that load, like Triton's ``<version>.model`` import. While model.py is imported, the version and model folders
are on ``sys.path`` as in Triton, so ``import helpers`` works too; modules found there are taken out of
``sys.modules`` afterwards, so another model with its own ``helpers.py`` gets its own. Bytecode is not written
into the model repository (that would change the folder a polling server watches).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import itertools
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from kiln.engines.python import compat
from kiln.errors import ConfigError

COMPAT_MODULE = "triton_python_backend_utils"
TRITON_CLASS = "TritonPythonModel"
KILN_CLASS = "KilnModel"

_PACKAGE_PREFIX = "kiln_python_model"
_IDENTIFIER = re.compile(r"\W")
_counter = itertools.count(1)
_import_lock = threading.Lock()  # sys.path and sys.dont_write_bytecode are process-wide


@dataclass
class ModelModule:
    """An imported model.py. ``unload`` forgets the module and everything imported relative to it."""

    module: ModuleType
    package: str

    def unload(self) -> None:
        _forget_package(self.package)


def import_model_file(model_name: str, model_file: Path) -> ModelModule:
    """Import ``model_file`` under a unique name; raise ConfigError naming the file when that fails."""
    if not model_file.is_file():
        raise ConfigError(f"model '{model_name}': model file {model_file} does not exist")
    sys.modules[COMPAT_MODULE] = compat
    package = f"{_PACKAGE_PREFIX}_{next(_counter)}_{_IDENTIFIER.sub('_', model_name)}"
    version_dir, model_dir = model_file.parent, model_file.parent.parent
    parent = importlib.util.module_from_spec(
        importlib.machinery.ModuleSpec(package, None, is_package=True))
    parent.__path__ = [str(version_dir)]
    sys.modules[package] = parent
    spec = importlib.util.spec_from_file_location(f"{package}.{model_file.stem}", model_file)
    if spec is None or spec.loader is None:
        _forget_package(package)
        raise ConfigError(f"model '{model_name}': {model_file} cannot be imported as Python source")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        with _import_lock, _importing_from(version_dir, model_dir):
            spec.loader.exec_module(module)
    except Exception as exc:  # a syntax error, a failed import or any error in the module's top-level code
        _forget_package(package)
        raise ConfigError(f"model '{model_name}': importing {model_file} failed: "
                          f"{type(exc).__name__}: {exc}") from exc
    return ModelModule(module=module, package=package)


def model_classes(module: ModuleType) -> dict[str, type]:
    """The model classes model.py defines, by name: TritonPythonModel and/or KilnModel."""
    return {name: cls for name in (TRITON_CLASS, KILN_CLASS) if isinstance(cls := getattr(module, name, None), type)}


def model_class(model_name: str, model_file: Path, module: ModuleType) -> tuple[type, bool]:
    """The one model class and whether it is Triton's; ConfigError unless there is exactly one, with execute()."""
    found = model_classes(module)
    if len(found) != 1:
        problem = "defines both" if found else "defines neither"
        raise ConfigError(f"model '{model_name}': {model_file} {problem} class {TRITON_CLASS} (Triton's Python "
                          f"backend API) and class {KILN_CLASS} (kiln's API); define exactly one")
    name, cls = next(iter(found.items()))
    if not callable(getattr(cls, "execute", None)):
        raise ConfigError(f"model '{model_name}': class {name} in {model_file} has no execute(self, requests) "
                          f"method; every Python model needs one")
    return cls, name == TRITON_CLASS


@contextlib.contextmanager
def _importing_from(version_dir: Path, model_dir: Path) -> Iterator[None]:
    added = [str(p) for p in (version_dir, model_dir) if str(p) not in sys.path]
    sys.path.extend(added)
    before = set(sys.modules)
    bytecode = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        yield
    finally:
        sys.dont_write_bytecode = bytecode
        for path in added:
            sys.path.remove(path)
        _forget_siblings(before, model_dir)


def _forget_siblings(before: set[str], model_dir: Path) -> None:
    """Drop modules imported by absolute name from the model's own folders (the importer keeps its reference)."""
    root = model_dir.resolve()
    for name in set(sys.modules) - before:
        if name.startswith(_PACKAGE_PREFIX):
            continue
        module = sys.modules.get(name)
        # __file__ for modules and regular packages, __path__ for namespace packages (folders without __init__).
        places = [getattr(module, "__file__", None) or "", *getattr(module, "__path__", [])]
        if any(place and root in Path(place).resolve().parents for place in places):
            sys.modules.pop(name, None)


def _forget_package(package: str) -> None:
    for name in [n for n in list(sys.modules) if n == package or n.startswith(package + ".")]:
        sys.modules.pop(name, None)
