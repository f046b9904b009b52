"""The ONNX Runtime build path: offline graph optimization, INT8 static quantization (QDQ), FP16 conversion."""

from __future__ import annotations

import collections
import importlib.util
import platform
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort

from kiln.build.calibration import Samples, batches
from kiln.errors import InternalError, InvalidArgumentError

# Saved graphs stop at EXTENDED: ALL adds layout transforms (NCHWc) tied to the CPU that made them, and ORT applies
# them again at load time anyway.
SAVED_LEVEL = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
CALIBRATION_METHODS = ("minmax", "entropy", "percentile")
INT8_TYPES = ("u8s8", "s8s8")


@dataclass(frozen=True)
class QuantizeInfo:
    method: str
    types: str
    reduce_range: bool
    per_channel: bool
    batches: int
    symbolic_shape_inference: bool


def optimize(source: Path, target: Path) -> None:
    """Apply ORT's graph optimizations (constant folding, fusions) and save the result as ``target``."""
    options = ort.SessionOptions()
    options.graph_optimization_level = SAVED_LEVEL
    options.optimized_model_filepath = str(target)
    try:
        ort.InferenceSession(str(source), sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own types for invalid or unsupported graphs
        raise InternalError(f"{source}: onnxruntime could not optimize the model: {exc}") from None


def convert_fp16(source: Path, target: Path) -> None:
    """Weights and activations in FP16; inputs and outputs stay FP32 (Casts at the edges), so callers don't change."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(source))
    converted = convert_float_to_float16(model, keep_io_types=True)
    onnx.save(converted, str(target))


def default_int8_types() -> tuple[str, bool]:
    """(types, reduce_range) that fuse into integer kernels on this CPU.

    x86 runs U8S8 (unsigned activations, signed weights) through VNNI/AVX2 kernels; S8S8 QDQ only partly fuses
    there and gains nothing. Without VNNI, 7-bit weights (reduce_range) avoid u8s8 saturation. ARM prefers S8S8.
    """
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i386", "i686"):
        return "u8s8", not _has_vnni()
    return "s8s8", False


def quantize_int8(source: Path, target: Path, samples: Samples, batch_size: int, *, method: str, types: str,
                  reduce_range: bool, on_batch: Callable[[int], None] | None = None) -> QuantizeInfo:
    """Static INT8 quantization in QDQ format, per-channel weights, calibrated on ``samples``."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if method not in CALIBRATION_METHODS:
        raise InvalidArgumentError(f"calibration method '{method}' is not supported; expected one of "
                                   f"{', '.join(CALIBRATION_METHODS)}")
    if types not in INT8_TYPES:
        raise InvalidArgumentError(f"INT8 types '{types}' are not supported; expected one of {', '.join(INT8_TYPES)}")
    methods = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
               "percentile": CalibrationMethod.Percentile}
    symbolic = importlib.util.find_spec("sympy") is not None  # symbolic shape inference needs sympy
    reader = _Reader(batches(samples, batch_size), on_batch)
    with tempfile.TemporaryDirectory(prefix="kiln-quant-") as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        quant_pre_process(str(source), str(prepared), skip_symbolic_shape=not symbolic)
        quantize_static(
            str(prepared), str(target), reader, quant_format=QuantFormat.QDQ, per_channel=True,
            reduce_range=reduce_range,
            activation_type=QuantType.QUInt8 if types == "u8s8" else QuantType.QInt8,
            weight_type=QuantType.QInt8, calibrate_method=methods[method],
        )
    return QuantizeInfo(method=method, types=types, reduce_range=reduce_range, per_channel=True,
                        batches=reader.count, symbolic_shape_inference=symbolic)


def runtime_op_counts(path: Path) -> dict[str, int]:
    """Node types of the graph ONNX Runtime actually runs (after all its optimizations) on this CPU: how a build
    shows whether quantized nodes fused into integer kernels."""
    with tempfile.TemporaryDirectory(prefix="kiln-opt-") as tmp:
        optimized = Path(tmp) / "optimized.onnx"
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = str(optimized)
        options.log_severity_level = 3  # the graph is only inspected: ORT's "hardware specific" warning is noise
        ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
        model = onnx.load(str(optimized), load_external_data=False)
    return dict(collections.Counter(node.op_type for node in model.graph.node).most_common())


class _Reader:
    """onnxruntime's CalibrationDataReader protocol (get_next returns a feed or None), counting batches."""

    def __init__(self, feeds: Iterator[Samples], on_batch: Callable[[int], None] | None) -> None:
        self._feeds = feeds
        self._on_batch = on_batch
        self.count = 0

    def get_next(self) -> dict[str, Any] | None:
        feed = next(self._feeds, None)
        if feed is not None:
            self.count += 1
            if self._on_batch is not None:
                self._on_batch(self.count)
        return feed

    def rewind(self) -> None:  # part of the protocol; calibration here reads the data once
        pass


def _has_vnni() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True  # unknown: assume a current CPU
    return "avx512_vnni" in flags or "avx_vnni" in flags
