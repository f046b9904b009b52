"""The direct path: load a model into an in-process engine. Where the model's config enables dynamic batching and
it runs on a GPU, the engine coalesces concurrent callers into batches with the server's batching core
(kiln.batching), on as many instances as the config's instance groups give the server."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from kiln.batching import BatchingPolicy, BatchLog, BatchModel, DynamicBatcher
from kiln.batching.model import ExecutionTimes
from kiln.config.backends import FILE_BACKENDS
from kiln.config.model_dir import ModelDir, open_model_dir
from kiln.config.onnx_io import FileTensor, read_onnx_io
from kiln.config.spec import ModelSpec
from kiln.config.validate import validate_config
from kiln.engines.base import Engine, EngineOptions, LaunchedBatch, create_engine, instance_group_options
from kiln.engines.checks import check_inputs, check_outputs
from kiln.engines.dlpack import prepare_inputs
from kiln.errors import ConfigError, InvalidArgumentError, ModelNotFoundError, VersionUnloadingError
from kiln.v2._generated import model_config_pb2 as pb
from kiln.v2.types import InferRequest, InferResponse, InputTensor, RequestedOutput

Array = npt.NDArray[Any]


def load(path: str | Path, version: int | None = None, *, batching: bool | None = None, **options: Any) -> Engine:
    """Load a model file (``model.onnx``) or a model folder (``<repo>/<model>``) into an engine.

    ``version`` picks a version folder (default: the newest the version policy serves). ``options`` are the
    fields of :class:`~kiln.engines.EngineOptions`: ``kind`` ("cpu" or "gpu"), ``device_id``,
    ``intra_op_threads``, ``inter_op_threads``. Those not given come from the folder's config, as the server's
    first instance would have them: a ``KIND_GPU`` instance group means ``kind="gpu"`` on its first listed GPU.
    A bare model file runs on the CPU unless told otherwise.

    ``batching``: coalesce concurrent ``infer`` / ``ainfer`` calls (threads, asyncio) into batches, as the
    server's dynamic batcher does (see :class:`BatchingEngine`). None (the default) follows the config's
    ``dynamic_batching`` (with its preferred sizes and max queue delay): on a GPU for every call; on the CPU for
    ``ainfer`` only, since there threads already run ``infer`` calls side by side and batching's bookkeeping costs
    them more than it saves, while coroutines gain (docs/scheduling.md). True batches every call of a model that
    batches (``max_batch_size`` > 0); False runs each call on its own.
    """
    _check_option_names(options)
    path = Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"{path}: no such model file or folder")
    if path.is_file() or path.suffix == ".onnx":
        if version is not None:
            raise InvalidArgumentError(f"{path}: version={version} applies to model folders, not to a model file")
        file_options = EngineOptions(**options)
        return _with_batching(create_engine(_spec_for_file(path), path, file_options), 1, batching, file_options.kind,
                              list)
    model_dir = open_model_dir(path)
    chosen = _choose_version(model_dir, version)
    engine_options = dataclasses.replace(config_engine_options(model_dir.spec), **options)
    engine = create_engine(model_dir.spec, model_dir.model_file(chosen), engine_options)

    def more_instances() -> list[Engine]:
        return _more_instances(model_dir, chosen, options)

    return _with_batching(engine, chosen, batching, engine_options.kind, more_instances)


class BatchingEngine(Engine):
    """An engine whose concurrent callers are served in batches by the server's dynamic batcher.

    Each ``infer`` (from any thread; unless ``batch_threads`` is False, the CPU default, where they run on their own)
    or ``ainfer`` (from any event loop) call is checked on its own, then queued; what is queued runs as one batch
    (same input shapes, up to max_batch_size, cut at a preferred batch size) and each caller gets its rows. A caller
    that finds the engine idle runs at once, on its own thread: the config's max queue delay is waited only while
    fewer callers are queued than the last batch held. Device (DLPack) inputs run on their own, unbatched.
    ``batch_log`` counts executions and batch sizes; ``engine`` is the first instance, whose own attributes read
    through; ``engines`` all of them.

    On engines that launch batches onto a GPU (the PyTorch backend), concurrent threads' calls are launched as the
    server launches its event loop's requests (kiln.batching.launched): a batch is staged and queued on one instance
    while another's runs, instead of each batch waiting for the device before the next is formed.
    """

    def __init__(self, engines: list[Engine], version: int, policy: BatchingPolicy, *,
                 batch_threads: bool = True) -> None:
        engine = engines[0]
        super().__init__(engine.spec)
        self.engine = engine
        self.engines = tuple(engines)
        self.thread_safe = engine.thread_safe
        self.launches = engine.launches
        self.accepts_torch_tensors = engine.accepts_torch_tensors
        self.policy = policy
        self.batch_threads = batch_threads  # False: infer() calls run on their own (the CPU default)
        self.batch_log = BatchLog()
        self._batcher = DynamicBatcher(BatchModel(engine.spec, version, list(engines), self.batch_log), policy,
                                       caller_runs=True)
        self._alone_lock = threading.Lock()
        self._running_alone = 0
        self._closed = False
        # An engine dropped without close() must not leave its worker threads waiting on the queue for good.
        self._finalizer = weakref.finalize(self, _stop, self._batcher)

    def infer(self, inputs: Mapping[str, npt.ArrayLike], outputs: Sequence[str] | None = None) -> dict[str, Array]:
        if not self.batch_threads:
            if self._closed:
                raise VersionUnloadingError(f"model '{self.name}' is closed")
            return self.engine.infer(inputs, outputs)
        request = self._request(inputs, outputs)
        if request is None:
            return self.engine.infer(inputs, outputs)
        if not self._batcher.launches:
            return _outputs(self._batcher.submit_sync(request, _rows(request)))
        if self._take_alone():
            try:
                return self._run_alone(request)
            finally:
                with self._alone_lock:
                    self._running_alone -= 1
        return _outputs(self._batcher.submit_launched_sync(request, _rows(request)))

    async def ainfer(self, inputs: Mapping[str, npt.ArrayLike],
                     outputs: Sequence[str] | None = None) -> dict[str, Array]:
        request = self._request(inputs, outputs)
        if request is None:
            return await super().ainfer(inputs, outputs)
        return _outputs(await self._batcher.submit(request, _rows(request)))

    def __getattr__(self, name: str) -> Any:
        """What the wrapped engine offers beyond the Engine interface (``providers``, ``device``, ...)."""
        if name == "engine":  # not set yet (during __init__): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        return self.engine.execute(inputs, outputs)

    def execute_parts(self, parts: Sequence[Mapping[str, Array]], outputs: Sequence[str]) -> dict[str, Array]:
        return self.engine.execute_parts(parts, outputs)

    def launch_parts(self, parts: Sequence[Mapping[str, Array]], outputs: Sequence[str]) -> LaunchedBatch | None:
        return self.engine.launch_parts(parts, outputs)

    def close(self) -> None:
        """Refuse new calls, answer the queued ones, then release the engines. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        _stop(self._batcher)

    def _take_alone(self) -> bool:
        """True (and counted) when nothing else is in flight and the last batch was a lone one: no company to wait
        for, so the call runs and waits on its own thread, sparing the hand-back from the device waiter. After a
        batch with company, the returning callers gather in the launch queue instead."""
        with self._alone_lock:
            if (self._closed or self._running_alone or self._batcher.inflight
                    or self.batch_log.last_batch_size > 1):
                return False
            self._running_alone += 1
            return True

    def _run_alone(self, request: InferRequest) -> dict[str, Array]:
        start_ns = time.monotonic_ns()
        arrays = {tensor.name: tensor.data for tensor in request.inputs}
        names = [wanted.name for wanted in request.outputs] or [tensor.name for tensor in self.spec.outputs]
        try:
            answer = self.engine.execute(arrays, names)
        except Exception:
            self.batch_log.record_failure(time.monotonic_ns() - start_ns)
            raise
        self.batch_log.record_success(ExecutionTimes(_rows(request), start_ns, 0, 0, 0), [start_ns],
                                      time.monotonic_ns())
        return answer

    def _request(self, inputs: Mapping[str, npt.ArrayLike], outputs: Sequence[str] | None) -> InferRequest | None:
        """The call as a request, checked before it joins a batch (so a bad call fails alone); None for calls
        that run unbatched (device tensors, tensors the engine takes as they are)."""
        prepared, device = prepare_inputs(self.name, inputs, keep_torch=self.accepts_torch_tensors)
        arrays = check_inputs(self.spec, prepared, keep_torch_tensors=self.accepts_torch_tensors)
        names = check_outputs(self.spec, outputs)
        if device is not None or not arrays or not all(isinstance(a, np.ndarray) for a in arrays.values()):
            return None
        specs = self.spec.input_map
        tensors = [InputTensor(name, specs[name].datatype, array.shape, array) for name, array in arrays.items()]
        wanted = [RequestedOutput(name) for name in names] if outputs is not None else []
        return InferRequest(self.name, tensors, outputs=wanted)


def _stop(batcher: DynamicBatcher) -> None:
    with contextlib.suppress(RuntimeError):  # collected on a worker thread itself: it ends on its own
        batcher.close()


def _rows(request: InferRequest) -> int:
    return int(request.inputs[0].shape[0])


def _outputs(response: InferResponse) -> dict[str, Array]:
    return {tensor.name: tensor.data for tensor in response.outputs}


def _with_batching(engine: Engine, version: int, batching: bool | None, kind: str,
                   more_instances: Callable[[], list[Engine]]) -> Engine:
    spec = engine.spec
    scheduling = spec.config.WhichOneof("scheduling_choice")
    batch_threads = batching is True or kind == "gpu"
    if batching is None:
        batching = scheduling == "dynamic_batching"
    if not batching:
        return engine
    if not spec.batching or scheduling == "sequence_batching":
        engine.close()
        why = "its config has sequence_batching" if spec.batching else "it has no batch dimension (max_batch_size 0)"
        raise InvalidArgumentError(f"model '{spec.name}': load(batching=True) cannot batch this model: {why}; "
                                   f"load it with batching=False")
    policy = (BatchingPolicy.from_config(spec.config) if scheduling == "dynamic_batching"
              else BatchingPolicy(max_batch_size=spec.config.max_batch_size))
    engines = [engine]
    if kind == "gpu":  # the server's instances, so that batches overlap as they do there
        try:
            engines += more_instances()
        except BaseException:
            engine.close()
            raise
    return BatchingEngine(engines, version, dataclasses.replace(policy, delay_needs_company=True),
                          batch_threads=batch_threads)


def _more_instances(model_dir: ModelDir, version: int, options: dict[str, Any]) -> list[Engine]:
    """The GPU instances the config's instance groups list after the first, with the caller's options applied."""
    listed = [each for group in model_dir.spec.config.instance_group for each in instance_group_options(group)]
    engines: list[Engine] = []
    try:
        for each in listed[1:]:
            if each.kind == "gpu":
                engines.append(create_engine(model_dir.spec, model_dir.model_file(version),
                                             dataclasses.replace(each, **options)))
    except BaseException:
        for created in engines:
            created.close()
        raise
    return engines


def config_engine_options(spec: ModelSpec) -> EngineOptions:
    """Where the server would put the config's first instance: the GPU its group lists first for KIND_GPU
    (device 0 when it lists none), else the CPU."""
    groups = spec.config.instance_group
    first = instance_group_options(groups[0]) if groups else []
    return first[0] if first else EngineOptions()


def _check_option_names(options: dict[str, Any]) -> None:
    known = EngineOptions.__dataclass_fields__
    unknown = [name for name in options if name not in known]
    if unknown:
        raise InvalidArgumentError(f"unknown load option(s) {', '.join(unknown)}; expected: {', '.join(known)}")


def _choose_version(model_dir: ModelDir, version: int | None) -> int:
    if version is not None:
        if version not in model_dir.versions:
            available = ", ".join(str(v) for v in model_dir.versions)
            raise ModelNotFoundError(f"model '{model_dir.name}' has no version {version} (available: {available})")
        return version
    served = model_dir.served_versions()
    if not served:
        raise ModelNotFoundError(f"model '{model_dir.name}': its version_policy selects none of the versions "
                                 f"{', '.join(str(v) for v in model_dir.versions)}")
    return served[-1]


def _spec_for_file(path: Path) -> ModelSpec:
    """A bare model file has no config: its own dims are used as they are, batch dimension included."""
    matches = [(backend, platform) for name, backend, platform in FILE_BACKENDS if path.suffix == Path(name).suffix]
    if not matches or matches[0][0] != "onnxruntime":
        raise ConfigError(f"{path}: kiln.load() reads .onnx files directly; put other model files in a model "
                          f"folder with a config.pbtxt")
    file_io = read_onnx_io(path)
    config = pb.ModelConfig(name=path.stem, backend="onnxruntime", platform="onnxruntime_onnx")
    for tensor in file_io.inputs:
        config.input.add(name=tensor.name, data_type=_config_type(tensor), dims=tensor.dims)
    for tensor in file_io.outputs:
        config.output.add(name=tensor.name, data_type=_config_type(tensor), dims=tensor.dims)
    return validate_config(config, path.stem, str(path), file_io)


def _config_type(tensor: FileTensor) -> pb.DataType:
    return cast("pb.DataType", tensor.datatype.config_number)
