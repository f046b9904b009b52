"""``kiln.build``: pre-flight, build, verify, then publish a version folder into a model repository.

A build happens in a hidden staging folder next to the output; only a build that passes verification is moved
into the repository (one rename), so a server watching the repository never sees a half-written or inaccurate
version.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.build import calibration, output
from kiln.build.backends import BACKEND_BUILDERS, BackendBuilder, BuildContext, BuildResult
from kiln.build.gpu_memory import GpuFootprint, instances_that_fit, measure_footprint
from kiln.build.progress import Progress
from kiln.build.report import REPORT_FILENAME, BuildReport, VerificationError
from kiln.build.sources import ModuleSource, OnnxSource
from kiln.build.torch_compile import compiler_scope, keep_cache
from kiln.build.verify import DEFAULT_TOLERANCES, Tolerances, compare, time_both
from kiln.config.model_dir import open_model_dir, version_folders
from kiln.config.onnx_io import FileIO
from kiln.config.parse import CONFIG_FILENAME, config_to_text, parse_config_text
from kiln.direct import load
from kiln.engines.base import Engine
from kiln.errors import InternalError, InvalidArgumentError, KilnError
from kiln.v2._generated import model_config_pb2 as pb

if TYPE_CHECKING:
    import torch

    from kiln.build.shapes import ShapeRange

Source = OnnxSource | ModuleSource

PRECISIONS = ("fp32", "fp16", "bf16", "int8")
DEFAULT_MAX_BATCH_SIZE = 8


@dataclass(frozen=True)
class BuildOptions:
    """Everything ``kiln build`` accepts; see docs/build.md for each field."""

    precision: str = "fp32"
    io_dtype: str = "model"  # model | fp16 | bf16: the config's type for the model's FP32 inputs and outputs
    backend: str = "onnxruntime"
    version: int | None = None
    calibration_data: Path | None = None
    calibration_method: str = "minmax"
    samples: int = 32
    max_batch_size: int | None = None
    shapes: Mapping[str, ShapeRange] = field(default_factory=dict)
    device: str = "cpu"
    int8_types: str | None = None
    torch_format: str = "export"
    channels_last: bool = False
    cuda_graphs: bool | None = None
    compile_mode: str = "auto"
    atol: float | None = None
    rtol: float | None = None
    min_top1: float | None = None
    seed: int = 0
    progress: bool = True

    def tolerances(self) -> Tolerances:
        default = DEFAULT_TOLERANCES[self.precision]
        given = self.atol is not None or self.rtol is not None  # values checked: the RMS fallback is not needed
        return Tolerances(atol=self.atol if self.atol is not None else default.atol,
                          rtol=self.rtol if self.rtol is not None else default.rtol,
                          min_top1=self.min_top1 if self.min_top1 is not None else default.min_top1,
                          max_nrmse=None if given else default.max_nrmse)


def build(model: str | Path | torch.nn.Module, output_dir: str | Path, options: BuildOptions | None = None, *,
          example_inputs: Any = None, **fields: Any) -> BuildReport:
    """Build ``model`` into ``output_dir`` (``<repository>/<model name>``) as a new version.

    ``model`` is an ONNX file, or a ``torch.nn.Module`` with ``example_inputs`` (a tensor or a tuple of tensors,
    batch dimension first) for the torch backend. Options come as a :class:`BuildOptions` or as its fields by
    keyword (``precision="int8"``), not both.

    Raises VerificationError (with the report) when the built engine misses a tolerance; nothing is published
    then. Returns the report, also written to ``<version>/build_report.json``.
    """
    options = _options(options, fields)
    model_dir = Path(output_dir)
    _check_options(options)
    source = _source(model, example_inputs, options)
    builder = BACKEND_BUILDERS[options.backend]
    progress = Progress(options.progress)
    with progress.step("preflight", f"pre-flight check for the {options.backend} backend"):
        builder.preflight(source, options)
    file_io = source.file_io()
    max_batch = _max_batch_size(file_io, options)
    version = output.choose_version(model_dir, options.version)
    samples = _samples(file_io, options, progress)
    staging_root = model_dir.parent / f".kiln-build-{model_dir.name}-{secrets.token_hex(4)}"
    staging = staging_root / model_dir.name
    try:
        version_dir = staging / str(version)
        version_dir.mkdir(parents=True)
        report = BuildReport(model=model_dir.name, source=source.description, output=str(model_dir / str(version)),
                             version=version, backend=options.backend, precision=options.precision)
        existing = _existing_parameters(model_dir)
        context = BuildContext(source=source, version_dir=version_dir, options=options, file_io=file_io,
                               samples=samples, max_batch_size=max_batch, progress=progress, report=report,
                               existing_parameters=existing)
        with compiler_scope(options, existing):
            result = _run_builder(builder, context, model_dir.name)
            _stage_config(model_dir, staging, result)
            footprint, load_s = _verify(source, staging, version, samples, options, progress, report)
            if options.backend == "torch" and report.passed:
                keep_cache(result, staging, version, load_s, progress, report)
        if not (model_dir / CONFIG_FILENAME).is_file():  # a generated config: fit its instances to the GPU
            _fit_instances(staging / CONFIG_FILENAME, footprint, report)
        report.timings_s = dict(progress.timings)
        report.write(version_dir / REPORT_FILENAME)
        if not report.passed:
            raise VerificationError(
                f"{model_dir.name}: the built engine failed verification: {'; '.join(report.accuracy.failures)}"
                if report.accuracy else f"{model_dir.name}: verification failed", report)
        if not (model_dir / CONFIG_FILENAME).is_file():
            output.write_config_atomic(model_dir, (staging / CONFIG_FILENAME).read_text())
        output.publish(version_dir, model_dir, version)
        return report
    finally:
        shutil.rmtree(staging_root, ignore_errors=True)


def _options(options: BuildOptions | None, fields: dict[str, Any]) -> BuildOptions:
    if options is not None and fields:
        raise InvalidArgumentError("pass build options either as BuildOptions or as keywords, not both")
    known = BuildOptions.__dataclass_fields__
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise InvalidArgumentError(f"unknown build option(s) {', '.join(unknown)}; expected: {', '.join(known)}")
    for key in ("calibration_data",):
        if isinstance(fields.get(key), str):
            fields[key] = Path(fields[key])
    return options or BuildOptions(**fields)


def _source(model: Any, example_inputs: Any, options: BuildOptions) -> Source:
    if isinstance(model, (str, Path)):
        path = Path(model)
        if not path.is_file() or path.suffix != ".onnx":
            raise InvalidArgumentError(f"{path}: kiln build reads an ONNX file (.onnx); no such file")
        if example_inputs is not None:
            raise InvalidArgumentError("example_inputs go with a torch module; an ONNX file declares its inputs")
        return OnnxSource(path)
    if type(model).__module__.startswith("torch") or hasattr(model, "forward"):
        if options.backend != "torch":
            raise InvalidArgumentError(f"a torch module builds with backend 'torch', not '{options.backend}'")
        if example_inputs is None:
            raise InvalidArgumentError("a torch module needs example_inputs (a tensor or a tuple of tensors)")
        return ModuleSource(model, example_inputs)
    raise InvalidArgumentError(f"kiln build takes an ONNX file path or a torch.nn.Module, not "
                               f"{type(model).__name__}")


def _check_options(options: BuildOptions) -> None:
    if options.precision not in PRECISIONS:
        raise InvalidArgumentError(f"--precision is '{options.precision}'; expected one of {', '.join(PRECISIONS)}")
    if options.backend not in BACKEND_BUILDERS:
        raise InvalidArgumentError(f"--backend is '{options.backend}'; expected one of "
                                   f"{', '.join(BACKEND_BUILDERS)}")
    if options.device not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"device is '{options.device}'; expected 'cpu' or 'cuda'")
    if options.samples < 1:
        raise InvalidArgumentError(f"samples is {options.samples}; expected at least 1")
    output.check_io_dtype(options.io_dtype, options.precision, options.backend)


def _max_batch_size(file_io: FileIO, options: BuildOptions) -> int:
    batchable = file_io.supports_batching()
    if options.max_batch_size is None:
        return DEFAULT_MAX_BATCH_SIZE if batchable else 0
    if options.max_batch_size < 0:
        raise InvalidArgumentError(f"--max-batch-size is {options.max_batch_size}; expected 0 or more")
    if options.max_batch_size > 0 and not batchable:
        fixed = [f"{t.name} {list(t.dims)}" for t in file_io.inputs + file_io.outputs if not t.dims or t.dims[0] != -1]
        raise InvalidArgumentError(f"--max-batch-size {options.max_batch_size} needs a dynamic first dimension on "
                                   f"every input and output; these have none: {', '.join(fixed)}")
    return options.max_batch_size


def _samples(file_io: FileIO, options: BuildOptions, progress: Progress) -> calibration.Samples:
    if options.calibration_data is not None:
        with progress.step("read_samples", f"reading samples from {options.calibration_data}"):
            return calibration.load_samples(options.calibration_data, file_io.inputs)
    opt_shapes = {name: tuple(r.opt[1:]) for name, r in options.shapes.items()}
    return calibration.generate_samples(file_io.inputs, options.samples, opt_shapes, options.seed)


def _run_builder(builder: BackendBuilder, context: BuildContext, name: str) -> BuildResult:
    """Backends raise their own exception types (ONNX Runtime, PyTorch, TensorRT): they become kiln errors here."""
    try:
        return builder.build(context)
    except KilnError:
        raise
    except Exception as exc:
        backend = context.options.backend
        raise InternalError(f"{name}: the {backend} build failed ({type(exc).__name__}: {exc})") from exc


def _stage_config(model_dir: Path, staging: Path, result: BuildResult) -> None:
    """Verification loads the version through the config the server will use: the existing one if there is one,
    which must ask for what this build made (backend, platform, engine parameters, instance kind)."""
    existing_file = model_dir / CONFIG_FILENAME
    file_io, max_batch = result.file_io, result.max_batch_size
    generated = result.config(model_dir.name, file_io, max_batch)
    if not existing_file.is_file():
        (staging / CONFIG_FILENAME).write_text(config_to_text(generated))
        return
    existing = open_model_dir(model_dir, autocomplete=False).spec.config if version_folders(model_dir) else None
    if existing is not None:
        mismatch = output.config_mismatch(existing, generated)
        if mismatch:
            raise InvalidArgumentError(
                f"{existing_file} does not fit this build: {mismatch}; build into a new model folder, or change "
                f"the config to match (the config of the build would be:\n{config_to_text(generated)})")
    shutil.copy2(existing_file, staging / CONFIG_FILENAME)


def _verify(source: Source, staging: Path, version: int, samples: calibration.Samples, options: BuildOptions,
            progress: Progress, report: BuildReport) -> tuple[GpuFootprint, float]:
    """Compare and time the built engine against the reference, and measure the GPU's limit for it; return the
    GPU memory the built engine took and the seconds its load took."""
    kind = "gpu" if options.device == "cuda" else "cpu"
    with source.reference() as reference, contextlib.ExitStack() as loaded:
        with measure_footprint(options.device) as footprint:  # the GPU limit's own graphs stay out of it
            with progress.step("load", "loading the built engine (compiling it, for a compiled build)"):
                started = time.perf_counter()
                built = loaded.enter_context(load(staging, version=version, kind=kind))
                load_s = time.perf_counter() - started
            max_batch = built.spec.max_batch_size  # the config the server will use, which may be an existing one
            batch = max(1, min(max_batch, 8))
            with progress.step("verify", f"verifying against the FP32 reference on "
                                         f"{calibration.sample_count(samples)} samples"):
                report.accuracy = compare(reference, built, samples, batch, options.tolerances())
            with progress.step("time", "timing reference and built engine"):
                sizes = sorted({1, max_batch} - {0})
                report.speed = [time_both(reference, built, samples, size) for size in sizes
                                if _fits(reference, size)]
        report.details["gpu_limit"] = _gpu_limit(built, options, progress)
    return footprint, load_s


def _gpu_limit(built: Engine, options: BuildOptions, progress: Progress) -> dict[str, Any]:
    """The GPU's own rows/s for the built engine at the config's preferred batch sizes (gpu_limit.py)."""
    if options.device != "cuda":
        return {"skipped": "a CPU build: there is no GPU to measure"}
    from kiln.build.gpu_limit import engine_gpu_limit

    spec = built.spec
    sizes = sorted(spec.config.dynamic_batching.preferred_batch_size) or [max(spec.max_batch_size, 1)]
    with progress.step("gpu_limit", f"measuring the GPU's limit at batch {', '.join(map(str, sizes))} from 1 and "
                                    f"2 CUDA streams"):
        return engine_gpu_limit(built, sizes)


def _existing_parameters(model_dir: Path) -> dict[str, str] | None:
    """The parameters of the model folder's config.pbtxt, if it has one that parses (_stage_config reports a
    broken one)."""
    path = model_dir / CONFIG_FILENAME
    if not path.is_file():
        return None
    try:
        config = parse_config_text(path.read_text(), str(path))
    except KilnError:
        return None
    return {key: value.string_value for key, value in config.parameters.items()}


def _fit_instances(config_path: Path, footprint: GpuFootprint, report: BuildReport) -> None:
    """Fewer GPU instances in the staged config when two copies of the engine would crowd the GPU. Nothing is
    recorded when PyTorch's pool did not grow (no CUDA build, or an engine that allocates outside it)."""
    if not footprint.engine_bytes:
        return
    config = parse_config_text(config_path.read_text(), str(config_path))
    groups = [group for group in config.instance_group if group.kind == pb.ModelInstanceGroup.KIND_GPU]
    if not groups:
        return
    fitting = instances_that_fit(footprint, groups[0].count)
    report.details["gpu_memory"] = {"engine_mib": round(footprint.engine_bytes / 2**20, 1),
                                    "gpu_total_mib": round((footprint.total_bytes or 0) / 2**20, 1),
                                    "instances": fitting}
    if fitting < groups[0].count:
        report.warnings.append(f"the config asks for {fitting} GPU instance(s), not {groups[0].count}: one takes "
                               f"{footprint.engine_bytes / 2**30:.1f} GiB of this GPU's "
                               f"{(footprint.total_bytes or 0) / 2**30:.1f} GiB")
        groups[0].count = fitting
        config_path.write_text(config_to_text(config))


def _fits(engine: Engine, batch: int) -> bool:
    """A reference with a fixed batch dimension can only be timed at that size."""
    return all(not t.dims or t.dims[0] in (-1, batch) for t in engine.inputs)
