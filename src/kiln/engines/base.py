"""The Engine interface every backend implements, and the registry that finds a backend by name.

An engine runs a batch in-process. ``infer()`` is the checked entry point for direct callers: it validates
names, dtypes and shapes against the model's spec and raises typed errors. ``execute()`` is the unchecked one the
server calls after it has validated a request once.
"""

from __future__ import annotations

import abc
import asyncio
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kiln.config.backend_autocomplete import register_config_completer
from kiln.config.backends import register_backend_name
from kiln.config.spec import ModelSpec, TensorSpec
from kiln.engines.checks import check_inputs, check_outputs
from kiln.engines.dlpack import outputs_like, prepare_inputs
from kiln.errors import InvalidArgumentError, UnsupportedError
from kiln.v2._generated import model_config_pb2 as pb
from kiln.v2.types import InferRequest, InferResponse

Array = npt.NDArray[Any]


@dataclass(frozen=True)
class EngineOptions:
    """Where and how an engine instance runs. ``kind`` is "cpu" or "gpu" (an instance group's kind).
    ``caller`` runs requests on the other models of the server that loads the engine (a Python model's BLS calls);
    None outside a server."""

    kind: str = "cpu"
    device_id: int = 0
    intra_op_threads: int | None = None
    inter_op_threads: int | None = None
    extra: Mapping[str, str] = field(default_factory=dict)
    caller: ModelCaller | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "gpu"):
            raise InvalidArgumentError(f"engine option kind is '{self.kind}'; expected 'cpu' or 'gpu'")


class ModelCaller(Protocol):
    """A server's request path as a model sees it: ``kiln.Server`` is one."""

    def infer_sync(self, request: InferRequest) -> InferResponse: ...


def instance_group_options(group: pb.ModelInstanceGroup, cpu_threads: int | None = None) -> list[EngineOptions]:
    """One EngineOptions per instance of ``group``: ``count`` per listed GPU (device 0 when it lists none) for
    KIND_GPU, ``count`` CPU instances with ``cpu_threads`` intra-op threads otherwise."""
    if group.kind == pb.ModelInstanceGroup.KIND_GPU:
        return [EngineOptions(kind="gpu", device_id=gpu) for gpu in list(group.gpus) or [0]
                for _ in range(group.count)]
    return [EngineOptions(kind="cpu", intra_op_threads=cpu_threads) for _ in range(group.count)]


class LaunchedBatch(Protocol):
    """A batch an engine has queued on its device (see :meth:`Engine.launch_parts`)."""

    def wait(self) -> None:
        """Block, without the GIL, until the device has finished the batch. Any thread may call it."""

    def collect(self) -> dict[str, Array]:
        """The batch's outputs, once :meth:`wait` has returned; gives the engine's buffers back. Call it exactly
        once, also after ``wait`` failed."""


class Engine(abc.ABC):
    """A loaded model that runs batches in-process."""

    thread_safe: bool = False
    """True when ``execute`` may run on several threads at once (the server then may run it inline)."""

    launches: bool = False
    """True when :meth:`launch_parts` can queue a batch on a device and return before it has run."""

    accepts_torch_tensors: bool = False
    """True when ``infer`` takes torch tensors as they are (a CUDA tensor stays on the GPU); others get numpy."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self.spec.inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self.spec.outputs

    def infer(self, inputs: Mapping[str, npt.ArrayLike], outputs: Sequence[str] | None = None) -> dict[str, Array]:
        """Run one batch. Raises InvalidArgumentError naming the tensor and what was expected.

        Inputs may be numpy arrays or DLPack objects (torch tensors, cupy arrays, ...). Device inputs give device
        outputs of the same kind; see :mod:`kiln.engines.dlpack` for the rule."""
        prepared, device = prepare_inputs(self.spec.name, inputs, keep_torch=self.accepts_torch_tensors)
        arrays = check_inputs(self.spec, prepared, keep_torch_tensors=self.accepts_torch_tensors)
        names = check_outputs(self.spec, outputs)
        return outputs_like(self.execute(arrays, names), device)

    async def ainfer(self, inputs: Mapping[str, npt.ArrayLike],
                     outputs: Sequence[str] | None = None) -> dict[str, Array]:
        """``infer`` for an event loop: runs on a worker thread (the batching engine of kiln.load coalesces it
        with other callers instead)."""
        return await asyncio.to_thread(self.infer, inputs, outputs)

    @abc.abstractmethod
    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        """Run already-validated inputs; return the requested outputs."""

    def execute_parts(self, parts: Sequence[Mapping[str, Array]], outputs: Sequence[str]) -> dict[str, Array]:
        """Several requests' validated inputs as one batch, rows in request order (a dynamic batch). This joins
        the rows and calls :meth:`execute`; an engine that can place each request's rows straight into its own
        buffers overrides it."""
        if len(parts) == 1:
            return self.execute(parts[0], outputs)
        return self.execute({name: np.concatenate([part[name] for part in parts]) for name in parts[0]}, outputs)

    def launch_parts(self, parts: Sequence[Mapping[str, Array]],
                     outputs: Sequence[str]) -> LaunchedBatch | None:
        """Queue a batch (as for :meth:`execute_parts`) on the engine's device and return without waiting for it;
        None when this engine cannot, or has no free buffers for another batch right now."""
        return None

    def close(self) -> None:  # noqa: B027  # optional hook: engines without resources need not override it
        """Release the engine's resources. Idempotent."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


EngineFactory = Callable[[ModelSpec, Path, EngineOptions], Engine]

# Built-in backends are imported on first use, so loading one never imports another's dependencies.
_BUILTIN: dict[str, str] = {
    "onnxruntime": "kiln.engines.onnxruntime:OnnxRuntimeEngine",
    "identity": "kiln.engines.identity:IdentityEngine",
    "pytorch": "kiln.engines.torch:TorchEngine",
    "tensorrt": "kiln.engines.tensorrt:TensorRTEngine",
    "python": "kiln.engines.python:python_engine",
}
_REGISTRY: dict[str, EngineFactory] = {}


def _python_auto_complete(config: dict[str, Any], model_file: Path) -> dict[str, Any] | None:
    from kiln.engines.python.autocomplete import run_auto_complete

    return run_auto_complete(config, model_file)


# Reading a Python model's folder runs its auto_complete_config, as Triton does.
register_config_completer("python", _python_auto_complete)


def register_backend(name: str, factory: EngineFactory, default_filename: str = "") -> None:
    """Make ``backend: "<name>"`` in a config load engines through ``factory(spec, model_file, options)``.
    ``default_filename`` is the model file looked for in a version folder ("" = none needed)."""
    _REGISTRY[name] = factory
    register_backend_name(name, default_filename)


def backend_names() -> list[str]:
    return sorted(set(_BUILTIN) | set(_REGISTRY))


def create_engine(spec: ModelSpec, model_file: Path, options: EngineOptions | None = None) -> Engine:
    factory = _REGISTRY.get(spec.backend)
    if factory is None and spec.backend in _BUILTIN:
        module_name, attr = _BUILTIN[spec.backend].split(":")
        factory = getattr(importlib.import_module(module_name), attr)
        _REGISTRY[spec.backend] = factory
    if factory is None:
        raise UnsupportedError(
            f"model '{spec.name}': backend '{spec.backend}' is not available in this kiln installation "
            f"(available: {', '.join(backend_names())})"
        )
    return factory(spec, model_file, options or EngineOptions())


def empty_like_spec(tensor: TensorSpec, batch: int) -> Array:
    """A zero tensor of the spec's shape (variable dims as 1): warmup and smoke tests."""
    dims = tuple(1 if d == -1 else d for d in tensor.dims)
    return np.zeros((batch, *dims), dtype=tensor.datatype.numpy_dtype)
