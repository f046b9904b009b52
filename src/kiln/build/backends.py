"""One builder per target backend: its pre-flight check and the steps that write the built model file."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import onnx
import onnxruntime as ort

from kiln.build import onnxruntime as ort_build
from kiln.build.calibration import Samples, sample_count
from kiln.build.output import make_config
from kiln.build.preflight import onnxruntime_unsupported, raise_if_unsupported
from kiln.build.progress import Progress
from kiln.build.report import BuildReport
from kiln.build.sources import ModuleSource, OnnxSource
from kiln.config.onnx_io import FileIO
from kiln.errors import UnavailableError, UnsupportedError
from kiln.v2._generated import model_config_pb2 as pb

if TYPE_CHECKING:
    from kiln.build.builder import BuildOptions

CALIBRATION_BATCH = 8


@dataclass
class BuildContext:
    source: OnnxSource | ModuleSource
    version_dir: Path
    options: BuildOptions
    file_io: FileIO
    samples: Samples
    max_batch_size: int
    progress: Progress
    report: BuildReport
    existing_parameters: Mapping[str, str] | None = None  # the model folder's config.pbtxt's, if it has one


@dataclass(frozen=True)
class BuildResult:
    """What the config of the built version must say to load it."""

    backend: str
    platform: str
    file_io: FileIO
    max_batch_size: int
    gpu: bool = False
    parameters: dict[str, str] = field(default_factory=dict)

    def config(self, name: str, file_io: FileIO, max_batch_size: int) -> pb.ModelConfig:
        return make_config(name, self.backend, self.platform, file_io, max_batch_size, gpu=self.gpu,
                           parameters=self.parameters)


class BackendBuilder(Protocol):
    def preflight(self, source: OnnxSource | ModuleSource, options: BuildOptions) -> None: ...

    def build(self, context: BuildContext) -> BuildResult: ...


class OnnxRuntimeBuilder:
    """ONNX in, ONNX out: optimized (fp32), converted (fp16) or quantized (int8) for ONNX Runtime."""

    def preflight(self, source: OnnxSource | ModuleSource, options: BuildOptions) -> None:
        path = onnx_path(source, "onnxruntime")
        if options.precision == "bf16":
            raise UnsupportedError("--precision bf16 is not available for the onnxruntime backend (its CPU kernels "
                                   "are FP32/INT8); use --backend torch for bf16")
        if options.device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
            raise UnavailableError("--device cuda with the onnxruntime backend needs onnxruntime-gpu (this "
                                   "onnxruntime has no CUDA execution provider); use --backend torch on this GPU")
        raise_if_unsupported("onnxruntime", path, onnxruntime_unsupported(path))

    def build(self, context: BuildContext) -> BuildResult:
        source = onnx_path(context.source, "onnxruntime")
        precision = context.options.precision
        target = context.version_dir / "model.onnx"
        report = context.report
        report.details["nodes_in_source"] = len(onnx.load(str(source), load_external_data=False).graph.node)
        if precision == "fp32":
            with context.progress.step("optimize", "optimizing the graph (ONNX Runtime, extended level)"):
                ort_build.optimize(source, target)
            report.steps.append("graph optimization (ORT_ENABLE_EXTENDED), saved as the built model")
        elif precision == "fp16":
            with context.progress.step("fp16", "converting weights and activations to FP16"):
                ort_build.convert_fp16(source, target)
            report.steps.append("FP16 conversion, FP32 inputs and outputs kept")
            if context.options.device == "cpu":
                report.warnings.append("FP16 does not speed up the ONNX Runtime CPU execution provider (it computes "
                                       "most operators in FP32 and adds casts); FP16 pays off on GPUs")
        else:
            self._quantize(context, source, target)
        with context.progress.step("inspect", "counting the operators ONNX Runtime runs"):
            report.details["runtime_ops"] = ort_build.runtime_op_counts(target)
        if precision == "int8":
            _warn_unfused(report)
        report.details["nodes_in_built_model"] = len(onnx.load(str(target), load_external_data=False).graph.node)
        gpu = context.options.device == "cuda"
        return BuildResult(backend="onnxruntime", platform="onnxruntime_onnx", file_io=context.file_io,
                           max_batch_size=context.max_batch_size, gpu=gpu)

    def _quantize(self, context: BuildContext, source: Path, target: Path) -> None:
        options, report = context.options, context.report
        default_types, default_reduce = ort_build.default_int8_types()
        types = options.int8_types or default_types
        reduce_range = default_reduce if types == default_types else False
        if options.calibration_data is None:
            report.warnings.append(f"INT8 scales come from {sample_count(context.samples)} random samples; pass "
                                   f"--calibration-data with real inputs for an accurate model")
        total = -(-sample_count(context.samples) // CALIBRATION_BATCH)
        title = f"calibrating ({options.calibration_method}) and quantizing to INT8 ({types.upper()})"
        with context.progress.step("calibrate", title, total=total) as advance:
            info = ort_build.quantize_int8(source, target, context.samples, CALIBRATION_BATCH,
                                           method=options.calibration_method, types=types,
                                           reduce_range=reduce_range, on_batch=advance)
        report.steps.append(f"INT8 static quantization: QDQ, per-channel weights, {types.upper()}, "
                            f"{info.method} calibration on {info.batches} batches")
        report.details["quantization"] = {
            "format": "QDQ", "types": info.types, "per_channel": info.per_channel, "reduce_range": info.reduce_range,
            "calibration_method": info.method, "calibration_batches": info.batches,
            "symbolic_shape_inference": info.symbolic_shape_inference,
        }


def onnx_path(source: OnnxSource | ModuleSource, backend: str) -> Path:
    if not isinstance(source, OnnxSource):
        raise UnsupportedError(f"the {backend} backend builds from an ONNX file; a torch module builds with the "
                               f"torch backend")
    return source.path


def _warn_unfused(report: BuildReport) -> None:
    """Quantized nodes help only when ORT fuses them into integer kernels; float ones left over cost speed."""
    ops: dict[str, int] = report.details["runtime_ops"]
    floating = {op: n for op, n in ops.items() if op in ("Conv", "FusedConv", "MatMul", "Gemm", "FusedMatMul")}
    if floating:
        listed = ", ".join(f"{n} {op}" for op, n in floating.items())
        report.warnings.append(f"after quantization ONNX Runtime still runs {listed} in floating point on this CPU")


def _builders() -> dict[str, BackendBuilder]:
    from kiln.build.tensorrt_backend import TensorRTBuilder
    from kiln.build.torch_build import TorchBuilder

    return {"onnxruntime": OnnxRuntimeBuilder(), "torch": TorchBuilder(), "tensorrt": TensorRTBuilder()}


BACKEND_BUILDERS: dict[str, BackendBuilder] = _builders()
