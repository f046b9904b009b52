"""``--compile-mode`` of the torch backend: what ``auto`` stands for, the measured choice between the eager engine
and the compiled one, and what a compiled build keeps beside its model file (``compile_cache.bin``) and reports
(how long a load takes cold and with the cache).

``auto`` on a CUDA build loads the exported program twice, as the config will run it (precision, layout, CUDA
graphs) and the same compiled with ``torch.compile(mode="default")``, times both at the config's preferred batch
sizes, and keeps the compiled one if it is at least MIN_GAIN faster there: compiling costs load time and a C++
compiler (and, on a GPU, Triton) on the serving machine, so a tie goes to the eager engine. ``auto`` does not
measure (and means ``none``) for a CPU build, where Inductor's C++ kernels seldom beat the mkldnn kernels the eager
module already runs while every load pays compiler start-up, for TorchScript and AOTInductor files, which
torch.compile does not take, and for a model folder whose config.pbtxt already says what it wants.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.build.verify import time_both
from kiln.engines.base import Engine

if TYPE_CHECKING:
    from kiln.build.backends import BuildContext, BuildResult
    from kiln.build.builder import BuildOptions
    from kiln.build.progress import Progress
    from kiln.build.report import BuildReport

AUTO = "auto"
CANDIDATE = "default"  # the mode auto measures: with kiln's own CUDA graphs, Inductor's graph modes are refused
MIN_GAIN = 0.05
COMPILE_MODE = "compile_mode"  # the config parameter (kiln.engines.torch.options, which imports torch)
PROBE_TIMEOUT_S = 1200


def decided_without_measuring(options: BuildOptions, existing: Mapping[str, str] | None) -> tuple[str, str] | None:
    """For ``--compile-mode auto``: the mode it stands for without measuring and why, or None to measure."""
    if existing is not None:
        return existing.get(COMPILE_MODE, "none"), "the model folder's config.pbtxt sets it"
    if options.torch_format != "export":
        return "none", f"torch.compile does not take --torch-format {options.torch_format}"
    if options.device != "cuda":
        return "none", ("a CPU build: Inductor's C++ kernels seldom beat the eager module's, and every load would "
                        "start a compiler")
    return None


def may_compile(options: BuildOptions, existing: Mapping[str, str] | None) -> bool:
    if options.backend != "torch" or options.compile_mode == "none":
        return False
    decided = decided_without_measuring(options, existing) if options.compile_mode == AUTO else None
    return decided is None or decided[0] != "none"


@contextlib.contextmanager
def compiler_scope(options: BuildOptions, existing: Mapping[str, str] | None) -> Iterator[None]:
    """Around a torch build that may compile: an empty Inductor cache of its own (so the first compile is a cold
    one, as on a fresh machine), and torch's recording of the compile caches' entries, which only this build's
    compiles feed (:func:`keep_cache` saves them)."""
    if not may_compile(options, existing):
        yield
        return
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    from kiln.engines.torch.compile_cache import recording

    triton = os.environ.get("TRITON_CACHE_DIR")  # Inductor points Triton into its cache folder on first use
    try:
        with tempfile.TemporaryDirectory(prefix="kiln-build-inductor-") as folder, temporary_cache_dir(folder), \
                recording():
            yield
    finally:
        if triton is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = triton


@dataclass(frozen=True)
class CandidateTiming:
    batch_size: int
    eager_ms: float
    compiled_ms: float

    def as_dict(self) -> dict[str, object]:
        return {"batch_size": self.batch_size, "eager_ms": round(self.eager_ms, 4),
                "compiled_ms": round(self.compiled_ms, 4),
                "eager_rows_per_s": round(1000 * self.batch_size / self.eager_ms, 1),
                "compiled_rows_per_s": round(1000 * self.batch_size / self.compiled_ms, 1),
                "speedup": round(self.eager_ms / self.compiled_ms, 3)}


def choose(context: BuildContext, model_file: Path, eager: BuildResult) -> str:
    """Load the eager and the compiled engine from ``model_file``, time both, record it all in the report under
    ``compile``, and return the mode to build with."""
    timings, load_s = _time_candidates(context, model_file, eager)
    eager_total, compiled_total = sum(t.eager_ms for t in timings), sum(t.compiled_ms for t in timings)
    mode = CANDIDATE if timings and compiled_total <= (1 - MIN_GAIN) * eager_total else "none"
    if timings:
        speed = f"{eager_total / compiled_total:.2f}x"
        why = (f"measured: at batch {_listed([t.batch_size for t in timings])} the compiled engine ran at {speed} "
               f"the eager one's speed; compiled is kept from {1 / (1 - MIN_GAIN):.2f}x on")
    else:
        speed, why = "untimed", "nothing could be timed (the inputs' first dimension is fixed to another size)"
    context.report.details["compile"] = {
        "requested": AUTO, "mode": mode, "candidate": CANDIDATE, "decided_by": why,
        "timings": [t.as_dict() for t in timings],
        "load_s": {label: round(seconds, 2) for label, seconds in load_s.items()},
    }
    kept = f"compiled ({CANDIDATE})" if mode != "none" else "eager"
    context.report.steps.append(f"--compile-mode auto: {kept} kept; the compiled engine ran at {speed} the eager "
                                f"one's speed")
    return mode


def _time_candidates(context: BuildContext, model_file: Path,
                     eager: BuildResult) -> tuple[list[CandidateTiming], dict[str, float]]:
    """Both candidates' timings at the preferred batch sizes, and the seconds each took to load."""
    from kiln.direct import load

    name = context.version_dir.parent.name
    compiled = replace(eager, parameters={**eager.parameters, COMPILE_MODE: CANDIDATE})
    kind = "gpu" if eager.gpu else "cpu"
    progress = context.progress
    engines: dict[str, Engine] = {}
    load_s: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-build-candidates-") as scratch, contextlib.ExitStack() as stack:
        for label, result, title in (("eager", eager, "loading the eager engine"),
                                     ("compiled_cold", compiled, f"compiling (torch.compile mode {CANDIDATE})")):
            folder = _candidate_folder(Path(scratch) / label / name, model_file, result)
            with progress.step(f"load_{label}", title):
                started = time.perf_counter()
                engines[label] = stack.enter_context(load(folder, version=1, kind=kind, batching=False))
                load_s[label] = time.perf_counter() - started
        sizes = _preferred_sizes(engines["eager"])
        with progress.step("choose", f"timing the eager and the compiled engine at batch {_listed(sizes)}"):
            timed = [time_both(engines["eager"], engines["compiled_cold"], context.samples, size) for size in sizes]
    return [CandidateTiming(t.batch_size, t.reference_ms, t.built_ms) for t in timed], load_s


def record_decision(report: BuildReport, mode: str, why: str) -> None:
    report.details["compile"] = {"requested": AUTO, "mode": mode, "decided_by": why}


def keep_cache(result: BuildResult, staging: Path, version: int, cold_load_s: float, progress: Progress,
               report: BuildReport) -> None:
    """After a compiled build passed verification: write ``compile_cache.bin`` into the version folder, then load
    the version in a fresh process with an empty Inductor cache, as a server on another machine would, and report
    how long that took and whether every graph came from the cache."""
    import torch

    from kiln.engines.torch.compile_cache import CACHE_FILENAME, save_compile_cache

    mode = result.parameters.get(COMPILE_MODE, "none")
    if mode == "none":
        return
    details = report.details.setdefault("compile", {"requested": mode, "mode": mode})
    details.setdefault("load_s", {}).setdefault("compiled_cold", round(cold_load_s, 2))
    device = torch.device("cuda", 0) if result.gpu else torch.device("cpu")
    size = save_compile_cache(staging / str(version) / CACHE_FILENAME, device, mode)
    if not size:
        report.warnings.append("torch.compile recorded nothing to cache: every load of this version compiles anew")
        return
    details["cache"] = {"file": CACHE_FILENAME, "bytes": size}
    with progress.step("cached_load", "loading the version in a fresh process with its compile cache"):
        probe = _fresh_process_load(staging, version, "gpu" if result.gpu else "cpu")
    details["cache"]["fresh_process"] = probe
    if "load_s" in probe:
        details["load_s"]["compiled_cached"] = probe["load_s"]
    if probe.get("fx_graph_misses") or "error" in probe:
        report.warnings.append(f"a fresh process did not load every compiled graph from {CACHE_FILENAME}: {probe}")


def _fresh_process_load(model_dir: Path, version: int, kind: str) -> dict[str, Any]:
    """What ``kiln.build.load_probe`` says after loading the version in a new interpreter with an empty Inductor
    cache (and Triton's inside it), or the error that kept it from saying."""
    with tempfile.TemporaryDirectory(prefix="kiln-build-fresh-inductor-") as folder:
        source = str(Path(__file__).resolve().parents[2])  # this kiln, also when it is not installed
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": folder,
               "PYTHONPATH": os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH", "")) if p)}
        env.pop("TRITON_CACHE_DIR", None)
        command = [sys.executable, "-m", "kiln.build.load_probe", str(model_dir), str(version), kind]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                                  check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"no answer within {PROBE_TIMEOUT_S} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": f"exit status {done.returncode}: {done.stderr.strip()[-500:]}"}
    answer: dict[str, Any] = json.loads(lines[-1])
    return answer


def _candidate_folder(folder: Path, model_file: Path, result: BuildResult) -> Path:
    """A model folder for one candidate: its config, and version 1 linking to the built model file."""
    from kiln.config.parse import CONFIG_FILENAME, config_to_text

    (folder / "1").mkdir(parents=True)
    (folder / CONFIG_FILENAME).write_text(config_to_text(result.config(folder.name, result.file_io,
                                                                       result.max_batch_size)))
    (folder / "1" / model_file.name).symlink_to(model_file.resolve())
    return folder


def _preferred_sizes(engine: Engine) -> list[int]:
    """The config's preferred batch sizes (the largest without them); for a model without a batch dimension, one
    sample, if its inputs take that."""
    spec = engine.spec
    if spec.max_batch_size > 0:
        return sorted(spec.config.dynamic_batching.preferred_batch_size) or [spec.max_batch_size]
    return [1] if all(not t.dims or t.dims[0] in (-1, 1) for t in engine.inputs) else []


def _listed(sizes: list[int]) -> str:
    return " and ".join(str(size) for size in sizes)
