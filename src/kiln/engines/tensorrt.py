"""TensorRT engine: runs a serialized TensorRT 10 plan (``model.plan``) on one GPU through the name-based I/O API.

``tensorrt`` and ``torch`` (kiln's only CUDA array library: device buffers and the stream) are imported when an
engine is created, never when kiln is imported. TensorRT 11 removed the precision flags and the INT8 calibrator
that kiln's builder uses, so kiln refuses it (``pip install 'kiln[tensorrt]'`` pins ``tensorrt>=10,<11``).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.config.spec import ModelSpec, TensorSpec
from kiln.engines.base import Array, Engine, EngineOptions
from kiln.errors import ConfigError, InternalError, InvalidArgumentError, UnavailableError, UnsupportedError
from kiln.tensor import DataType

if TYPE_CHECKING:
    import torch

INSTALL_HINT = "pip install 'kiln[tensorrt]'"
_log = logging.getLogger("kiln.tensorrt")

# TensorRT DataType member names -> kiln types. FP8, INT4, FP4 and E8M0 exist only inside networks.
TRT_DATATYPES: dict[str, DataType] = {
    "FLOAT": DataType.FP32,
    "HALF": DataType.FP16,
    "BF16": DataType.BF16,
    "INT8": DataType.INT8,
    "INT32": DataType.INT32,
    "INT64": DataType.INT64,
    "BOOL": DataType.BOOL,
    "UINT8": DataType.UINT8,
}
_LOG_LEVELS = {"INTERNAL_ERROR": logging.CRITICAL, "ERROR": logging.ERROR, "WARNING": logging.WARNING,
               "INFO": logging.INFO, "VERBOSE": logging.DEBUG}


def check_tensorrt_version(version: str) -> tuple[int, int]:
    """Return (major, minor) for a TensorRT 10 version string; refuse any other major version."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise UnsupportedError(f"TensorRT reports version '{version}'; kiln's TensorRT backend needs 10.x "
                               f"({INSTALL_HINT})")
    major, minor = int(match.group(1)), int(match.group(2))
    if major >= 11:
        raise UnsupportedError(
            f"TensorRT {version} is installed, but kiln's TensorRT backend uses the TensorRT 10 API: TensorRT 11 "
            f"removed the FP16/BF16/INT8 builder flags and the INT8 calibrator it relies on; install TensorRT 10 "
            f"with {INSTALL_HINT} (tensorrt>=10,<11)")
    if major < 10:
        raise UnsupportedError(f"TensorRT {version} is installed, but kiln's TensorRT backend needs TensorRT 10 "
                               f"(name-based tensor I/O and execute_async_v3); upgrade with {INSTALL_HINT}")
    return major, minor


def import_tensorrt() -> Any:
    """The ``tensorrt`` module, checked to be 10.x; UnavailableError with the install hint when missing."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise UnavailableError(f"the TensorRT backend needs the 'tensorrt' package, which cannot be imported "
                               f"({exc}); install it with {INSTALL_HINT}") from None
    check_tensorrt_version(str(getattr(trt, "__version__", "unknown")))
    return trt


def cuda_device(device_id: int, what: str) -> torch.device:
    """The torch CUDA device ``device_id``; UnavailableError when torch or the device is missing."""
    try:
        import torch
    except ImportError as exc:
        raise UnavailableError(f"{what}: TensorRT buffers are torch CUDA tensors, but torch cannot be imported "
                               f"({exc}); install it with pip install 'kiln[torch]'") from None
    if not torch.cuda.is_available():
        raise UnavailableError(f"{what}: TensorRT needs a CUDA GPU, and none is visible "
                               f"(torch.cuda.is_available() is False)")
    count = torch.cuda.device_count()
    if not 0 <= device_id < count:
        raise UnavailableError(f"{what}: GPU {device_id} was requested; visible GPUs: 0..{count - 1}")
    return torch.device("cuda", device_id)


_LOGGER: Any = None
_LOGGER_LOCK = threading.Lock()


def tensorrt_logger(trt: Any) -> Any:
    """kiln's one TensorRT logger (older TensorRT treats the logger as a process-wide singleton).

    It forwards messages to the ``kiln.tensorrt`` logging channel; ``with logger.capture() as errors:`` collects
    the ERROR messages of the calling thread, so failures can say why.
    """
    global _LOGGER
    with _LOGGER_LOCK:
        if _LOGGER is None:
            _LOGGER = _logger_class(trt)()
        return _LOGGER


def _logger_class(trt: Any) -> type:
    class KilnTensorRTLogger(trt.ILogger):  # type: ignore[misc]  # tensorrt is untyped
        def __init__(self) -> None:
            trt.ILogger.__init__(self)  # pybind11 trampolines need the base initialised explicitly
            self._local = threading.local()

        def log(self, severity: Any, msg: str) -> None:
            level = _LOG_LEVELS.get(getattr(severity, "name", ""), logging.WARNING)
            if level >= logging.ERROR:
                captured = getattr(self._local, "messages", None)
                if captured is not None:
                    captured.append(msg)
            if _log.isEnabledFor(level):
                _log.log(level, "%s", msg)

        @contextlib.contextmanager
        def capture(self) -> Iterator[list[str]]:
            previous = getattr(self._local, "messages", None)
            messages: list[str] = []
            self._local.messages = messages
            try:
                yield messages
            finally:
                self._local.messages = previous

    return KilnTensorRTLogger


@dataclass(frozen=True)
class PlanTensor:
    """One I/O tensor of a plan: TensorRT type name ("FLOAT", "HALF", ...), shape (-1 = dynamic) and, for
    dynamic inputs, the min/max shapes of optimization profile 0."""

    name: str
    is_input: bool
    dtype: str
    shape: tuple[int, ...]
    profile_min: tuple[int, ...] | None = None
    profile_max: tuple[int, ...] | None = None


def describe_plan(trt: Any, engine: Any) -> tuple[PlanTensor, ...]:
    tensors: list[PlanTensor] = []
    for index in range(engine.num_io_tensors):
        name = engine.get_tensor_name(index)
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        shape = tuple(int(d) for d in engine.get_tensor_shape(name))
        low = high = None
        if is_input and -1 in shape:
            low_dims, _, high_dims = engine.get_tensor_profile_shape(name, 0)
            low, high = tuple(int(d) for d in low_dims), tuple(int(d) for d in high_dims)
        tensors.append(PlanTensor(name, is_input, engine.get_tensor_dtype(name).name, shape, low, high))
    return tuple(tensors)


def check_plan_io(spec: ModelSpec, plan: Sequence[PlanTensor]) -> None:
    """Raise ConfigError naming every way the config's inputs/outputs differ from the plan's tensors.

    Every plan input needs a config input; config outputs must be plan outputs (plan outputs the config leaves
    out are computed and dropped). Types must agree, and ranks with the batch dimension counted when batching.
    """
    inputs = {t.name: t for t in plan if t.is_input}
    outputs = {t.name: t for t in plan if not t.is_input}
    problems: list[str] = []
    for tensor in spec.inputs:
        problems += _compare(spec, tensor, "input", inputs, outputs)
    for tensor in spec.outputs:
        problems += _compare(spec, tensor, "output", outputs, inputs)
    for name, found in inputs.items():
        if name not in spec.input_map:
            problems.append(f"the plan has input '{name}' ({found.dtype} {_dims(found.shape)}), which the config "
                            f"does not declare")
    for name, found in outputs.items():  # undeclared outputs are still computed, so kiln must allocate them
        if name not in spec.output_map and found.dtype not in TRT_DATATYPES:
            problems.append(f"the plan has output '{name}' of TensorRT type {found.dtype}, which kiln cannot "
                            f"allocate")
    if problems:
        raise ConfigError(f"model '{spec.name}': config.pbtxt does not match model.plan: {'; '.join(problems)}")


def _compare(spec: ModelSpec, tensor: TensorSpec, kind: str, same: Mapping[str, PlanTensor],
             others: Mapping[str, PlanTensor]) -> list[str]:
    found = same.get(tensor.name)
    if found is None:
        if tensor.name in others:
            return [f"config {kind} '{tensor.name}' is an {'output' if kind == 'input' else 'input'} in the plan"]
        return [f"config {kind} '{tensor.name}' is not in the plan (plan {kind}s: {', '.join(same) or 'none'})"]
    problems: list[str] = []
    datatype = TRT_DATATYPES.get(found.dtype)
    if datatype is None:
        problems.append(f"plan {kind} '{found.name}' has TensorRT type {found.dtype}, which kiln cannot "
                        f"{'feed' if kind == 'input' else 'return'}")
    elif datatype is not tensor.datatype:
        problems.append(f"{kind} '{tensor.name}' is {tensor.datatype.config_name} in the config but {found.dtype} "
                        f"({datatype.config_name}) in the plan")
    model_dims = tensor.reshape if tensor.reshape is not None else tensor.dims
    expected = ((-1,) + model_dims) if spec.batching else model_dims
    if len(found.shape) != len(expected):
        batch = ", batch dimension included (max_batch_size > 0)" if spec.batching else ""
        problems.append(f"{kind} '{tensor.name}' has {len(found.shape)} dimensions in the plan "
                        f"({_dims(found.shape)}) but {len(expected)} in the config ({_dims(expected)}{batch})")
        return problems
    if spec.batching and found.shape[0] != -1:
        problems.append(f"{kind} '{tensor.name}' has a fixed first dimension {found.shape[0]} in the plan; with "
                        f"max_batch_size > 0 it must be dynamic (rebuild with a batch range, or set "
                        f"max_batch_size: 0 and dims {list(found.shape)})")
    for index, (have, want) in enumerate(zip(found.shape, expected, strict=True)):
        if have >= 0 and want >= 0 and have != want and not (spec.batching and index == 0):
            problems.append(f"{kind} '{tensor.name}' dimension {index} is {have} in the plan but {want} in the "
                            f"config")
    if spec.batching and found.profile_max is not None and found.profile_min is not None:
        if found.profile_max[0] < spec.max_batch_size or found.profile_min[0] > 1:
            problems.append(f"input '{tensor.name}' accepts batch sizes {found.profile_min[0]}..."
                            f"{found.profile_max[0]} in the plan's profile, but max_batch_size {spec.max_batch_size} "
                            f"needs 1...{spec.max_batch_size}")
    return problems


def _dims(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def torch_dtype(datatype: DataType) -> torch.dtype:
    import torch

    types = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16,
             DataType.INT8: torch.int8, DataType.INT32: torch.int32, DataType.INT64: torch.int64,
             DataType.BOOL: torch.bool, DataType.UINT8: torch.uint8}
    return types[datatype]


def to_torch(array: Array, device: torch.device | str) -> torch.Tensor:
    """Copy a numpy array to ``device`` (bfloat16 travels as its int16 bits: torch cannot read ml_dtypes)."""
    import torch

    if not array.flags.c_contiguous or not array.flags.writeable:
        array = np.array(array, order="C")  # torch warns on read-only buffers (zero-copy request views)
    if array.dtype == DataType.BF16.numpy_dtype:
        return torch.from_numpy(array.view(np.int16)).to(device).view(torch.bfloat16)
    return torch.from_numpy(array).to(device)


def to_numpy(tensor: torch.Tensor) -> Array:
    import torch

    host = tensor.cpu()  # waits for the tensor's stream
    if host.dtype == torch.bfloat16:
        return host.view(torch.int16).numpy().view(DataType.BF16.numpy_dtype)
    return host.numpy()


class TensorRTEngine(Engine):
    thread_safe = False  # one execution context per engine: TensorRT contexts run one inference at a time

    def __init__(self, spec: ModelSpec, model_file: Path, options: EngineOptions) -> None:
        super().__init__(spec)
        trt = import_tensorrt()
        if not Path(model_file).is_file():
            raise ConfigError(f"model '{spec.name}': model file {model_file} does not exist")
        # A plan only runs on a GPU: KIND_CPU instances (kiln's KIND_AUTO default) use options.device_id too.
        self._device = cuda_device(options.device_id, f"model '{spec.name}'")
        import torch

        logger = tensorrt_logger(trt)
        with torch.cuda.device(self._device), logger.capture() as errors:
            runtime = trt.Runtime(logger)
            engine = runtime.deserialize_cuda_engine(Path(model_file).read_bytes())
            if engine is None:
                raise ConfigError(f"model '{spec.name}': TensorRT {trt.__version__} cannot deserialize "
                                  f"{model_file}: {'; '.join(errors) or 'no reason given'}; a plan runs only with "
                                  f"the TensorRT version and GPU model that built it")
            self._plan = describe_plan(trt, engine)
            check_plan_io(spec, self._plan)
            context = engine.create_execution_context()
            if context is None:
                raise UnavailableError(f"model '{spec.name}': TensorRT cannot create an execution context on GPU "
                                       f"{options.device_id}: {'; '.join(errors) or 'no reason given'}")
            stream = torch.cuda.Stream(device=self._device)  # type: ignore[no-untyped-call]  # unannotated in torch
            self._stream: torch.cuda.Stream | None = stream
        self._runtime, self._engine, self._context = runtime, engine, context
        self._logger = logger
        self._lock = threading.Lock()

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        import torch

        with self._lock:
            context, stream = self._require_context()
            with torch.cuda.device(self._device), torch.cuda.stream(stream), self._logger.capture() as errors:
                # The input buffers stay referenced until the outputs are copied back (to_numpy waits for the stream).
                staged = [self._bind_input(context, plan, inputs) for plan in self._plan if plan.is_input]
                results = {plan.name: self._bind_output(context, plan) for plan in self._plan if not plan.is_input}
                if not context.execute_async_v3(stream.cuda_stream):
                    raise InternalError(f"model '{self.spec.name}': TensorRT execution failed: "
                                        f"{'; '.join(errors) or 'no reason given'}")
                answer = {name: self._from_model(name, to_numpy(results[name])) for name in outputs}
            del staged
            return answer

    def close(self) -> None:
        with self._lock:
            self._context = self._engine = self._runtime = None
            self._stream = None

    def _require_context(self) -> tuple[Any, torch.cuda.Stream]:
        if self._context is None or self._stream is None:
            raise UnavailableError(f"model '{self.spec.name}': the engine is closed")
        return self._context, self._stream

    def _bind_input(self, context: Any, plan: PlanTensor, inputs: Mapping[str, Array]) -> torch.Tensor:
        array = inputs.get(plan.name)
        if array is None:
            raise InvalidArgumentError(f"model '{self.spec.name}': input '{plan.name}' is required by the "
                                       f"TensorRT plan")
        tensor_spec = self.spec.input_map[plan.name]
        if tensor_spec.reshape is not None:
            lead = (array.shape[0],) if self.spec.batching else ()
            array = array.reshape(lead + tensor_spec.reshape)
        tensor = to_torch(array, self._device)
        if not context.set_input_shape(plan.name, tuple(tensor.shape)):
            accepted = (f"{_dims(plan.profile_min)} to {_dims(plan.profile_max)}"
                        if plan.profile_min is not None and plan.profile_max is not None else _dims(plan.shape))
            raise InvalidArgumentError(f"model '{self.spec.name}': input '{plan.name}' has shape "
                                       f"{_dims(tensor.shape)} for the plan; it accepts {accepted}")
        context.set_tensor_address(plan.name, tensor.data_ptr())
        return tensor

    def _bind_output(self, context: Any, plan: PlanTensor) -> torch.Tensor:
        import torch

        shape = tuple(int(d) for d in context.get_tensor_shape(plan.name))
        if any(d < 0 for d in shape):
            raise UnsupportedError(f"model '{self.spec.name}': output '{plan.name}' has a data-dependent shape "
                                   f"{_dims(shape)}; kiln's TensorRT engine needs output shapes that follow from "
                                   f"the input shapes")
        buffer = torch.empty(shape, dtype=torch_dtype(TRT_DATATYPES[plan.dtype]), device=self._device)
        context.set_tensor_address(plan.name, buffer.data_ptr())
        return buffer

    def _from_model(self, name: str, array: Array) -> Array:
        tensor = self.spec.output_map.get(name)
        if tensor is not None and tensor.reshape is not None:
            lead = (array.shape[0],) if self.spec.batching else ()
            array = array.reshape(lead + tensor.dims)
        return array
