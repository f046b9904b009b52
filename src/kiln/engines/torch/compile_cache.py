"""torch.compile's output kept with a model version, so that loading it does not compile again.

``kiln build`` compiles the module while it verifies the build, collects what torch's compile caches recorded
meanwhile (``torch.compiler.save_cache_artifacts``: Inductor's FX graph cache entries with their kernels,
AOTAutograd's, autotuning results) and writes them beside the model file as ``compile_cache.bin``. The engine
hands those bytes to ``torch.compiler.load_cache_artifacts`` before its first compiled call: torch.compile still
traces the module (dynamo), but finds every graph it would compile in the cache and only loads it.

The file starts with a line naming what made it (torch version, device, compile mode). Inductor's cache keys hold
those too, so a cache from elsewhere would only miss; the line lets the engine say why in a warning instead of
silently compiling for minutes. Any problem with the file (absent, unreadable, made elsewhere) ends in compiling
as if there were no cache, never in a failed load.
"""

from __future__ import annotations

import copyreg
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln._files import write_atomic

log = logging.getLogger("kiln.engines.torch")

CACHE_FILENAME = "compile_cache.bin"
_MAGIC = b"kiln compile cache 1\n"


def _memory_format(name: str) -> torch.memory_format:
    """``torch.channels_last`` for ``"torch.channels_last"``: how a memory format is pickled in a kiln process."""
    value = getattr(torch, name.removeprefix("torch."))
    assert isinstance(value, torch.memory_format)
    return value


# Inductor's cache keys are hashes of pickled graph inputs, and pickle finds a memory format (whose reduce gives
# only "torch.contiguous_format") in the first module of sys.modules with a global named torch: a module that
# differs between processes (the build's, a server's, a test runner's), so the same graph missed the cache of
# another process. Pickled by name through this module instead, as torch pickles its layouts, the key is the same
# in every process that loads kiln's PyTorch engine.
copyreg.pickle(torch.memory_format, lambda value: (_memory_format, (str(value),)))


@dataclass(frozen=True)
class CacheLoad:
    """What became of a version's compile cache at load: ``loaded`` (with how many entries), ``absent``,
    ``stale`` (made by another torch, device or compile mode) or ``unreadable``; ``detail`` says why."""

    status: str
    detail: str = ""
    entries: int = 0


@dataclass(frozen=True)
class CompileCounts:
    """Inductor FX graphs found in the cache and compiled anew, as torch's counters say (process-wide)."""

    hits: int
    misses: int

    def since(self, before: CompileCounts) -> CompileCounts:
        return CompileCounts(self.hits - before.hits, self.misses - before.misses)


def compile_counts() -> CompileCounts:
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return CompileCounts(inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"])


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def cache_stamp(device: torch.device, compile_mode: str) -> dict[str, str]:
    """What a cache is only good for: the torch that wrote it, the device it compiled for, the compile mode."""
    return {"torch": torch.__version__, "device": device_name(device), "compile_mode": compile_mode}


def supported() -> bool:
    """Whether this torch saves and loads compile caches (torch 2.7 and later)."""
    return hasattr(torch.compiler, "save_cache_artifacts") and hasattr(torch.compiler, "load_cache_artifacts")


@contextmanager
def recording() -> Iterator[None]:
    """Collect only what torch.compile records inside the block (other compiles of the process stay out)."""
    if not supported():
        yield
        return
    from torch.compiler._cache import CacheArtifactManager

    with CacheArtifactManager.with_fresh_cache():
        yield


def save_compile_cache(path: Path, device: torch.device, compile_mode: str) -> int:
    """Write what was recorded (call inside :func:`recording`, after compiling) to ``path``; return its size in
    bytes, 0 when torch recorded nothing (no file is written then)."""
    saved = torch.compiler.save_cache_artifacts() if supported() else None
    if saved is None:
        return 0
    artifacts, _ = saved
    data = _MAGIC + json.dumps(cache_stamp(device, compile_mode), sort_keys=True).encode() + b"\n" + artifacts
    write_atomic(path, data)
    return len(data)


def load_compile_cache(model: str, path: Path, device: torch.device, compile_mode: str) -> CacheLoad:
    """Put the cache at ``path`` into torch's compile caches, or log why not (the caller compiles either way)."""
    if not path.is_file():
        return CacheLoad("absent")
    if not supported():
        return _unusable(model, path, "unreadable", f"torch {torch.__version__} cannot load compile caches; 2.7 "
                                                    f"and later can")
    try:
        stamp, artifacts = _read(path)
    except (OSError, ValueError) as exc:
        return _unusable(model, path, "unreadable", str(exc))
    here = cache_stamp(device, compile_mode)
    differences = [f"{key} {stamp.get(key)!r}, not {value!r}" for key, value in here.items()
                   if stamp.get(key) != value]
    if differences:
        return _unusable(model, path, "stale", f"it was made for {'; '.join(differences)}")
    try:
        info = torch.compiler.load_cache_artifacts(artifacts)
    except Exception as exc:  # torch raises what its unpickling of the entries raises
        return _unusable(model, path, "unreadable", f"torch could not read it ({type(exc).__name__}: {exc})")
    if info is None:  # torch logged why
        return _unusable(model, path, "unreadable", "torch could not read its entries")
    return CacheLoad("loaded", entries=sum(len(keys) for keys in info.artifacts.values()))


def _read(path: Path) -> tuple[dict[str, str], bytes]:
    data = path.read_bytes()
    if not data.startswith(_MAGIC):
        raise ValueError("it is not a kiln compile cache (its first line is wrong)")
    header, newline, artifacts = data[len(_MAGIC):].partition(b"\n")
    try:
        stamp = json.loads(header) if newline else None
    except ValueError:
        stamp = None
    if not isinstance(stamp, dict):
        raise ValueError("its header line is not a JSON object")
    return {str(key): str(value) for key, value in stamp.items()}, artifacts


def _unusable(model: str, path: Path, status: str, detail: str) -> CacheLoad:
    log.warning("model '%s': the compile cache %s is not used (%s); torch.compile compiles the model anew, which "
                "takes longer", model, path, detail)
    return CacheLoad(status, detail)
