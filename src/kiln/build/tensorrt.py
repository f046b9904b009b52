"""Build a TensorRT 10 plan from an ONNX file, and ask TensorRT's ONNX parser which nodes it cannot take.

The flow is TensorRT 10's: Builder -> create_network (STRONGLY_TYPED when the ONNX holds Q/DQ nodes, so tensor
types follow the file and no precision flag is set) -> OnnxParser -> builder config (workspace pool, optimization
level, FP16/BF16/INT8 flags, optimization profile, timing cache, INT8 calibrator) -> build_serialized_network.
INT8 without Q/DQ nodes calibrates with TensorRT's entropy or minmax calibrator over the batches given;
``percentile`` is an ONNX Runtime calibration method that TensorRT 10 does not have, so it is refused.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import onnx

from kiln.build.shapes import ShapeRange, format_shape, resolve_shapes
from kiln.engines.tensorrt import (
    TRT_DATATYPES,
    cuda_device,
    import_tensorrt,
    tensorrt_logger,
    to_torch,
)
from kiln.errors import InternalError, InvalidArgumentError, KilnError, UnavailableError, UnsupportedError

if TYPE_CHECKING:
    import torch

PRECISIONS = ("fp32", "fp16", "bf16", "int8")
CALIBRATION_METHODS = ("entropy", "minmax")
_PRECISION_FLAGS = {"fp32": (), "fp16": ("FP16",), "bf16": ("BF16",), "int8": ("INT8",)}
_QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}


@dataclass(frozen=True)
class TensorRTBuildInfo:
    """What a build did. ``calibration`` is "none", "entropy", "minmax" or "cache" (scales read from the
    calibration cache, no batches run); ``network_layers`` counts the parsed network's layers, before fusion."""

    plan_path: Path
    precision: str
    strongly_typed: bool
    builder_flags: tuple[str, ...]
    profile: Mapping[str, ShapeRange]
    calibration: str
    calibration_batches: int
    timing_cache: Path | None
    timing_cache_reused: bool
    network_layers: int
    plan_bytes: int
    build_seconds: float
    tensorrt_version: str
    notes: tuple[str, ...] = field(default=())


class UnsupportedNode(NamedTuple):
    op_type: str
    node_name: str
    reason: str


@dataclass(frozen=True)
class ParserIssue:
    """One ONNX parser error: the node's index in the graph (-1 for the graph itself), name, operator, code."""

    node: int
    name: str
    op_type: str
    code: str
    desc: str


def check_build_options(precision: str, calibration_method: str, workspace_bytes: int,
                        optimization_level: int) -> None:
    if precision not in PRECISIONS:
        raise InvalidArgumentError(f"precision is '{precision}'; expected one of: {', '.join(PRECISIONS)}")
    if calibration_method == "percentile":
        raise UnsupportedError("calibration method 'percentile' is not available with TensorRT: TensorRT 10 "
                               "calibrates with entropy (IInt8EntropyCalibrator2) or minmax (IInt8MinMaxCalibrator); "
                               "pick one of those, or build with --backend onnxruntime for percentile calibration")
    if calibration_method not in CALIBRATION_METHODS:
        raise InvalidArgumentError(f"calibration method is '{calibration_method}'; expected one of: "
                                   f"{', '.join(CALIBRATION_METHODS)}")
    if workspace_bytes < 1:
        raise InvalidArgumentError(f"workspace_bytes is {workspace_bytes}; expected a positive number of bytes")
    if not 0 <= optimization_level <= 5:
        raise InvalidArgumentError(f"optimization_level is {optimization_level}; TensorRT accepts 0..5 (default 3)")


def has_qdq(model: onnx.ModelProto) -> bool:
    """True when any node (subgraphs and local functions included) is a QuantizeLinear/DequantizeLinear."""
    graphs: list[onnx.GraphProto] = [model.graph]
    nodes: list[onnx.NodeProto] = [n for f in model.functions for n in f.node]
    while graphs:
        graph = graphs.pop()
        nodes.extend(graph.node)
        for node in graph.node:
            for attribute in node.attribute:
                graphs.extend([attribute.g] if attribute.HasField("g") else [])
                graphs.extend(attribute.graphs)
    return any(n.op_type in _QDQ_OPS and n.domain in ("", "ai.onnx") for n in nodes)


def load_onnx(path: Path) -> onnx.ModelProto:
    """The graph of an ONNX file, without its external weights (TensorRT reads those itself)."""
    if not path.is_file():
        raise InvalidArgumentError(f"{path}: no such ONNX file")
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises its own decode errors
        raise InvalidArgumentError(f"{path}: not a readable ONNX model ({exc})") from None


def describe_parser_issues(path: Path, model: onnx.ModelProto, issues: Sequence[ParserIssue]) -> str:
    """One message naming every node the parser failed on (names from the ONNX graph where TensorRT gave none)."""
    lines = []
    for issue in issues:
        name, op_type = _node_label(model, issue)
        where = f"node {issue.node} '{name}' ({op_type})" if issue.node >= 0 else "the graph"
        lines.append(f"{where}: {issue.code}: {issue.desc}")
    return f"TensorRT cannot parse {path}: {len(issues)} error(s): {'; '.join(lines) or 'no reason given'}"


def nodes_outside(model: onnx.ModelProto, covered: Iterable[int],
                  issues: Sequence[ParserIssue]) -> list[UnsupportedNode]:
    """Nodes that failed to parse or lie outside every subgraph TensorRT supports, in graph order."""
    reasons = {issue.node: f"{issue.code}: {issue.desc}" for issue in issues if issue.node >= 0}
    inside = set(covered)
    found = [UnsupportedNode(node.op_type, node.name or f"#{index}",
                             reasons.get(index, "reads a graph input that TensorRT rejected"))
             for index, node in enumerate(model.graph.node) if index in reasons or index not in inside]
    found += [UnsupportedNode("", "(graph)", f"{issue.code}: {issue.desc}") for issue in issues if issue.node < 0]
    return found


def _node_label(model: onnx.ModelProto, issue: ParserIssue) -> tuple[str, str]:
    if issue.name or issue.op_type or not 0 <= issue.node < len(model.graph.node):
        return issue.name, issue.op_type
    node = model.graph.node[issue.node]
    return node.name, node.op_type


def _parser_issues(parser: Any) -> list[ParserIssue]:
    issues = []
    for index in range(parser.num_errors):
        error = parser.get_error(index)
        # node_name()/node_operator() exist from TensorRT 10.2; earlier 10.x gives the node index only.
        name = error.node_name() if hasattr(error, "node_name") else ""
        op_type = error.node_operator() if hasattr(error, "node_operator") else ""
        issues.append(ParserIssue(int(error.node()), name, op_type, str(error.code()), error.desc()))
    return issues


def unsupported_nodes(onnx_path: Path | str) -> list[UnsupportedNode]:
    """Ask TensorRT's ONNX parser which nodes of ``onnx_path`` it cannot take: (op_type, node_name, reason).

    An empty list means the parser supports the whole model (the build may still fail on GPU-specific limits).
    """
    path = Path(onnx_path)
    model = load_onnx(path)
    trt = import_tensorrt()
    logger = tensorrt_logger(trt)
    builder = _builder(trt, logger)
    network = builder.create_network(_network_flags(trt, has_qdq(model)))
    parser = trt.OnnxParser(network, logger)
    data = path.read_bytes()
    if hasattr(parser, "supports_model_v2"):  # TensorRT 10.1+; supports_model is deprecated there
        supported = parser.supports_model_v2(data, str(path))
        covered = [i for s in range(parser.num_subgraphs) for i in parser.get_subgraph_nodes(s)]
    else:
        supported, subgraphs = parser.supports_model(data, str(path))
        covered = [int(i) for nodes, _ in subgraphs for i in nodes]
    return [] if supported else nodes_outside(model, covered, _parser_issues(parser))


class CalibrationFeed:
    """Copies calibration batches into device buffers for TensorRT's calibrator, which calls from C++: nothing
    here may raise into it, so the first problem is kept in ``error`` and ends calibration."""

    def __init__(self, batches: Iterable[Mapping[str, Any]], expected: Mapping[str, tuple[tuple[int, ...], Any]],
                 device: torch.device | str, cache: Path | None = None) -> None:
        self._batches = iter(batches)
        self._expected = {name: (tuple(shape), np.dtype(dtype)) for name, (shape, dtype) in expected.items()}
        self._device = device
        self._buffers: dict[str, torch.Tensor] = {}
        self.cache = cache
        self.count = 0
        self.error: KilnError | None = None

    def next_pointers(self, names: Sequence[str]) -> list[int] | None:
        """Device addresses of the next batch's tensors, in ``names`` order; None when done or failed."""
        if self.error is not None:
            return None
        try:
            batch = next(self._batches, None)
            if batch is None:
                return None
            pointers = self._copy(names, batch)
        except KilnError as exc:
            self.error = exc
            return None
        except Exception as exc:  # the caller's batch iterable may raise anything
            self.error = InternalError(f"calibration batch {self.count + 1} could not be read: {exc!r}")
            return None
        self.count += 1
        return pointers

    def read_cache(self) -> bytes | None:
        try:
            data = self.cache.read_bytes() if self.cache is not None and self.cache.is_file() else b""
        except OSError as exc:
            self.error = InvalidArgumentError(f"calibration cache {self.cache} cannot be read: {exc}")
            return None
        return data or None

    def write_cache(self, data: Any) -> None:
        if self.cache is None:
            return
        try:
            _write_atomic(self.cache, bytes(data))
        except OSError as exc:
            self.error = InvalidArgumentError(f"calibration cache {self.cache} cannot be written: {exc}")

    def _copy(self, names: Sequence[str], batch: Mapping[str, Any]) -> list[int]:
        label = f"calibration batch {self.count + 1}"
        unknown = sorted(set(batch) - set(self._expected))
        if unknown:
            raise InvalidArgumentError(f"{label} has input '{unknown[0]}', which the network does not have "
                                       f"(inputs: {', '.join(self._expected)})")
        pointers = []
        for name in names:
            if name not in batch:
                raise InvalidArgumentError(f"{label} is missing input '{name}' (it has: {', '.join(batch)})")
            shape, dtype = self._expected[name]
            array = np.asarray(batch[name])
            if array.dtype != dtype:
                raise InvalidArgumentError(f"{label}: input '{name}' has dtype {array.dtype}; expected {dtype}")
            if array.shape != shape:
                raise InvalidArgumentError(f"{label}: input '{name}' has shape {format_shape(array.shape)}; "
                                           f"expected {format_shape(shape)} (the profile's opt shape, which "
                                           f"TensorRT calibrates with)")
            buffer = self._buffers.get(name)
            if buffer is None:
                buffer = self._buffers[name] = to_torch(array, self._device)
            else:
                buffer.copy_(to_torch(array, "cpu"))
            pointers.append(int(buffer.data_ptr()))
        if any(b.is_cuda for b in self._buffers.values()):
            import torch

            torch.cuda.synchronize(self._device)  # TensorRT reads the buffers on its own stream
        return pointers


def _make_calibrator(trt: Any, method: str, feed: CalibrationFeed) -> Any:
    base = trt.IInt8EntropyCalibrator2 if method == "entropy" else trt.IInt8MinMaxCalibrator

    class KilnCalibrator(base):  # type: ignore[misc,valid-type]  # tensorrt is untyped
        def __init__(self) -> None:
            base.__init__(self)  # pybind11 trampolines need the base initialised explicitly

        def get_batch_size(self) -> int:
            return 1  # explicit-batch networks carry the batch in each tensor's shape

        def get_batch(self, names: Sequence[str]) -> list[int] | None:
            return feed.next_pointers(names)

        def read_calibration_cache(self) -> bytes | None:
            return feed.read_cache()

        def write_calibration_cache(self, cache: Any) -> None:
            feed.write_cache(cache)

    return KilnCalibrator()


def _builder(trt: Any, logger: Any) -> Any:
    builder = trt.Builder(logger)
    if builder is None:
        raise UnavailableError("TensorRT cannot create a builder (no usable CUDA GPU?)")
    return builder


def _network_flags(trt: Any, strongly_typed: bool) -> int:
    return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly_typed else 0


def _write_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(temporary, "wb") as file:
        file.write(data)
    temporary.replace(path)


def build_plan(onnx_path: Path | str, plan_path: Path | str, *, precision: str = "fp32",
               shapes: Mapping[str, ShapeRange] | None = None, max_batch_size: int | None = None,
               calibration_batches: Iterable[Mapping[str, Any]] | None = None,
               calibration_method: str = "entropy", calibration_cache: Path | None = None,
               timing_cache: Path | None = None, workspace_bytes: int = 1 << 30, optimization_level: int = 3,
               device_id: int = 0) -> TensorRTBuildInfo:
    """Build ``plan_path`` from ``onnx_path`` with TensorRT 10 (see the module docstring for the flow).

    ``shapes`` gives min/opt/max per dynamic input; an input whose only dynamic dimension is the batch may rely on
    ``max_batch_size`` instead. INT8 on a model without Q/DQ nodes needs ``calibration_batches`` (dicts of input
    name -> array of the profile's opt shape) or an existing ``calibration_cache``, which is used instead of the
    batches when present and written after a calibration. ``timing_cache`` is read when it exists and written
    after the build. A plan runs only on the GPU model and TensorRT version that built it.
    """
    onnx_path, plan_path = Path(onnx_path), Path(plan_path)
    check_build_options(precision, calibration_method, workspace_bytes, optimization_level)
    model = load_onnx(onnx_path)
    strongly_typed = has_qdq(model)
    calibrate = _needs_calibration(onnx_path, precision, strongly_typed, calibration_batches, calibration_cache)
    trt = import_tensorrt()
    logger = tensorrt_logger(trt)
    started = time.monotonic_ns()
    with _on_device(device_id, calibrate, f"building {onnx_path}") as device, logger.capture() as errors:
        builder, network = _parse(trt, logger, onnx_path, model, strongly_typed)
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
        config.builder_optimization_level = optimization_level
        flags = () if strongly_typed else _PRECISION_FLAGS[precision]
        for flag in flags:
            config.set_flag(getattr(trt.BuilderFlag, flag))
        inputs = {t.name: (tuple(int(d) for d in t.shape), t.dtype.name)
                  for t in (network.get_input(i) for i in range(network.num_inputs))}
        ranges = resolve_shapes({name: dims for name, (dims, _) in inputs.items()}, shapes, max_batch_size)
        profile = _add_profile(builder, config, ranges)
        notes, reused = _set_timing_cache(config, timing_cache)
        feed = None
        if calibrate:
            expected = {name: (ranges[name].opt if name in ranges else dims, _numpy_type(name, trt_type))
                        for name, (dims, trt_type) in inputs.items()}
            feed = CalibrationFeed(calibration_batches or (), expected, device, calibration_cache)
            _set_calibrator(trt, config, profile, calibration_method, feed)
        plan = builder.build_serialized_network(network, config)
        _check_built(onnx_path, plan, feed, errors)
    seconds = (time.monotonic_ns() - started) / 1e9
    _write_atomic(plan_path, plan)
    if timing_cache is not None:
        _write_atomic(timing_cache, config.get_timing_cache().serialize())
    if strongly_typed and calibration_batches is not None:
        notes += ("calibration data unused: the model is explicitly quantized (Q/DQ nodes)",)
    count = feed.count if feed is not None else 0
    return TensorRTBuildInfo(
        plan_path=plan_path, precision=precision, strongly_typed=strongly_typed, builder_flags=tuple(flags),
        profile=ranges, calibration="none" if feed is None else (calibration_method if count else "cache"),
        calibration_batches=count, timing_cache=timing_cache, timing_cache_reused=reused,
        network_layers=int(network.num_layers), plan_bytes=int(plan.nbytes), build_seconds=seconds,
        tensorrt_version=str(trt.__version__), notes=notes)


def _needs_calibration(onnx_path: Path, precision: str, strongly_typed: bool,
                       batches: Iterable[Mapping[str, Any]] | None, cache: Path | None) -> bool:
    if strongly_typed and precision != "int8":
        raise InvalidArgumentError(
            f"{onnx_path} holds QuantizeLinear/DequantizeLinear nodes, so TensorRT builds it strongly typed and its "
            f"precision is the file's own; build it with precision 'int8', not '{precision}'")
    calibrate = precision == "int8" and not strongly_typed
    if calibrate and batches is None and not _cache_exists(cache):
        raise InvalidArgumentError(f"INT8 for {onnx_path} needs calibration data (CLI: --calibration-data) or an "
                                   f"existing calibration cache; without them TensorRT would use placeholder scales")
    return calibrate


def _cache_exists(cache: Path | None) -> bool:
    return cache is not None and cache.is_file() and cache.stat().st_size > 0


@contextlib.contextmanager
def _on_device(device_id: int, need_torch: bool, what: str) -> Iterator[torch.device | str]:
    """Make GPU ``device_id`` current for the build: TensorRT builds on the current CUDA device (0 unless set).
    torch sets it, so torch is needed for another GPU than 0 and for calibration buffers, not otherwise."""
    if device_id == 0 and not need_torch:
        yield "cuda:0"
        return
    device = cuda_device(device_id, what)
    import torch

    with torch.cuda.device(device):
        yield device


def _parse(trt: Any, logger: Any, onnx_path: Path, model: onnx.ModelProto, strongly_typed: bool) -> tuple[Any, Any]:
    builder = _builder(trt, logger)
    network = builder.create_network(_network_flags(trt, strongly_typed))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        raise UnsupportedError(describe_parser_issues(onnx_path, model, _parser_issues(parser)))
    return builder, network


def _check_built(onnx_path: Path, plan: Any, feed: CalibrationFeed | None, errors: Sequence[str]) -> None:
    if feed is not None and feed.error is not None:
        raise feed.error
    if feed is not None and feed.count == 0 and not _cache_exists(feed.cache):
        raise InvalidArgumentError(f"INT8 calibration of {onnx_path} received no batches; the calibration data "
                                   f"is empty")
    if plan is None:
        raise InternalError(f"TensorRT could not build {onnx_path}: {'; '.join(errors) or 'no reason given'}")


def _numpy_type(name: str, trt_type: str) -> Any:
    datatype = TRT_DATATYPES.get(trt_type)
    if datatype is None:
        raise UnsupportedError(f"network input '{name}' has TensorRT type {trt_type}, which calibration cannot feed")
    return datatype.numpy_dtype


def _add_profile(builder: Any, config: Any, ranges: Mapping[str, ShapeRange]) -> Any:
    if not ranges:
        return None
    profile = builder.create_optimization_profile()
    for name, shape_range in ranges.items():
        profile.set_shape(name, min=shape_range.min, opt=shape_range.opt, max=shape_range.max)
    if config.add_optimization_profile(profile) < 0:
        listed = ", ".join(f"{name}:{r.format()}" for name, r in ranges.items())
        raise InvalidArgumentError(f"TensorRT rejected the optimization profile {listed}")
    return profile


def _set_timing_cache(config: Any, path: Path | None) -> tuple[tuple[str, ...], bool]:
    """Start from ``path``'s cache when it exists (returns notes, reused); one TensorRT rejects (another GPU or
    TensorRT version, or damaged) is replaced by an empty cache, which the build then fills."""
    if path is None:
        return (), False
    data = path.read_bytes() if path.is_file() else b""
    cache = config.create_timing_cache(data) if data else None
    if cache is not None and config.set_timing_cache(cache, ignore_mismatch=False):
        return (), True
    config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)  # empty buffer = new cache
    return ((f"timing cache {path} was not usable here (another GPU or TensorRT version?); it was replaced",)
            if data else ()), False


def _set_calibrator(trt: Any, config: Any, profile: Any, method: str, feed: CalibrationFeed) -> None:
    # The calibrator API is deprecated since TensorRT 10.1 (explicit quantization supersedes it) and removed in
    # 11; kiln pins TensorRT 10 and uses it knowingly, so its DeprecationWarnings are silenced here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        config.int8_calibrator = _make_calibrator(trt, method, feed)
        if profile is not None:
            config.set_calibration_profile(profile)
