"""The PyTorch engine: TorchScript (``model.pt``) and PT2 archives (``model.pt2``: AOTInductor packages and
exported programs), on the CPU or one CUDA device, with optional fp16/bf16, channels_last, torch.compile and one
CUDA graph per batch size. See docs/pytorch-backend.md.

Thread safety: a plain module runs on several threads at once (torch releases the GIL, and a forward pass keeps no
state). A compiled module does not (``thread_safe`` is False unless CUDA graphs replay it): dynamo and inductor are
not thread-safe (pytorch/pytorch#118260, #123177), so calls into any compiled module of the process also take one
process-wide lock. A compiled module's batch dimension is dynamic (one graph serves every batch size but 1, which
torch specialises), and the version's compile cache (compile_cache.py), when there is one, is loaded before the
first compiled call. The engine compiles while it loads: a warm-up runs the largest batch and a batch of 1, so the
CUDA graph captures that follow, and the calls, find both graphs compiled.

CUDA graphs replay static buffers, so each concurrent caller takes a lane (lanes.py): a CUDA stream with its own
graphs and pinned staging buffers, up to ``cuda_streams`` of them, so that several callers' copies and kernels
overlap on the GPU instead of taking turns under one lock. A lane can also be launched from the
event loop (``launch_parts``) and collected when its stream is done. Large batches (``cuda_shared_stream_from_batch``
rows or more) replay on one stream shared by the model's instances, so the GPU runs them one at a time.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.config.spec import ModelSpec, TensorSpec
from kiln.engines.base import Array, Engine, EngineOptions, LaunchedBatch
from kiln.engines.torch.compile_cache import (
    CACHE_FILENAME,
    CacheLoad,
    CompileCounts,
    compile_counts,
    load_compile_cache,
)
from kiln.engines.torch.cuda_graphs import CudaGraphs, SharedStream, shared_compute_stream
from kiln.engines.torch.lanes import LanePool
from kiln.engines.torch.loading import LoadedModel, ModelFormat, detect_format, ignoring, load_model
from kiln.engines.torch.naming import input_positions, output_positions, select_outputs
from kiln.engines.torch.options import (
    CHANNELS_LAST,
    COMPILE_MODE,
    CUDA_GRAPHS,
    TorchSettings,
    read_settings,
)
from kiln.engines.torch.pinned_host import HostRows, host_rows
from kiln.engines.torch.staging import RowStaging, numpy_view
from kiln.engines.torch.tensors import checked_output, host_tensor, to_device, to_numpy, torch_dtype
from kiln.errors import ConfigError, InternalError, KilnError, UnavailableError

log = logging.getLogger("kiln.engines.torch")

_COMPILED_CALLS = threading.Lock()
# The largest batch a compiled module warms up with: Inductor tunes its dynamic-batch graph for this size (or the
# max batch size when smaller), and a larger one would only cost memory at load.
WARM_UP_BATCH = 64

Tensors = Sequence[torch.Tensor | None]


@dataclass
class GraphLane:
    """What one caller holds while it runs a batch on the GPU: a stream, its graphs, its pinned input buffers, the
    device buffers its graphs read (one per input, in the config's dtype, sized for the largest batch and shared by
    every batch size's graph) and the pinned buffers its outputs are copied into."""

    stream: torch.cuda.Stream
    graphs: CudaGraphs
    staging: dict[str, RowStaging]
    static_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    host_outputs: dict[str, RowStaging] = field(default_factory=dict)
    done: torch.cuda.Event = field(default_factory=torch.cuda.Event)  # recorded after a launched batch


class TorchEngine(Engine):
    thread_safe = True
    accepts_torch_tensors = True

    def __init__(self, spec: ModelSpec, model_file: Path, options: EngineOptions) -> None:
        super().__init__(spec)
        # Mistakes in the config and the file are reported first, whatever machine this runs on.
        self.settings = read_settings(spec, options)
        self.format = detect_format(spec, model_file)
        _check_format(spec, self.format, self.settings)
        self._input_dtypes = {t.name: torch_dtype(spec, t, "input") for t in spec.inputs}
        self._input_numpy_dtypes = {name: numpy_view(torch.empty(0, dtype=dtype)).dtype
                                    for name, dtype in self._input_dtypes.items()}
        self._output_dtypes = {t.name: torch_dtype(spec, t, "output") for t in spec.outputs}
        if self.settings.cuda_graphs:
            _check_static(spec)
        self.device = _device(spec, options)
        self._device_index = self.device.index if self.device.index is not None else 0
        _apply_threads(self.settings, options)
        loaded = load_model(spec, model_file, self.format, self.device, single_threaded=self.settings.cuda_graphs)
        _check_device(spec, loaded, self.device)
        self._dict_input = loaded.dict_input
        self._order = _argument_order(spec, loaded)
        self._output_positions = output_positions(spec)
        self._compiled = self.settings.compile_mode != "none"
        # With CUDA graphs a call replays graphs; only captures run the compiled module, under the process lock.
        self.thread_safe = not self._compiled or self.settings.cuda_graphs
        # What became of the version's compile cache, and the graphs found in torch's caches or compiled while
        # loading (both None for a module that is not compiled).
        self.compile_cache: CacheLoad | None = None
        self.compile_counts: CompileCounts | None = None
        if self._compiled:
            self.compile_cache = load_compile_cache(spec.name, model_file.parent / CACHE_FILENAME, self.device,
                                                    self.settings.compile_mode)
        counted_from = compile_counts() if self._compiled else None
        started = time.perf_counter()
        self._function: Callable[..., Any] | None = _prepare(loaded, self.settings)
        self._lanes: LanePool[GraphLane] | None = None
        self._shared_stream: SharedStream | None = None
        self._shared_from = self.settings.cuda_shared_stream_from_batch or 0
        if self.settings.cuda_graphs and self._shared_from and spec.batching:
            self._shared_stream = shared_compute_stream(spec.name, self.device)
        if self._compiled:
            self._warm_up()
        if self.settings.cuda_graphs:
            # An AOTInductor package runs single-threaded for capture and may keep buffers between runs, so its
            # graphs are not replayed on several streams at once.
            streams = 1 if self.format is ModelFormat.AOTI else self.settings.cuda_streams
            self._lanes = LanePool(self._new_lane, streams)
            self._capture_listed()
            self.launches = True
        if counted_from is not None:
            self._check_compile_counts(counted_from, time.perf_counter() - started)

    @property
    def cuda_graph_batch_sizes(self) -> tuple[int, ...]:
        """Batch sizes with a captured CUDA graph on any lane (0 stands for a model without a batch dimension)."""
        lanes = self._lanes.lanes if self._lanes is not None else ()
        return tuple(sorted({size for lane in lanes for size in lane.graphs.batch_sizes}))

    @property
    def cuda_graph_capture_order(self) -> tuple[int, ...]:
        """The first lane's batch sizes in the order they were captured (the listed ones at load, then others)."""
        lanes = self._lanes.lanes if self._lanes is not None else ()
        return lanes[0].graphs.capture_order if lanes else ()

    @property
    def cuda_graph_count(self) -> int:
        """CUDA graphs captured so far over all lanes (each lane captures a batch size on its first use)."""
        lanes = self._lanes.lanes if self._lanes is not None else ()
        return sum(len(lane.graphs.batch_sizes) for lane in lanes)

    @property
    def shared_compute_stream(self) -> torch.cuda.Stream | None:
        """The stream this model's instances replay batches of ``cuda_shared_stream_from_batch`` rows or more on
        (one per model and GPU); None when the parameter is off or the engine replays no graphs."""
        return self._shared_stream.stream if self._shared_stream is not None else None

    @property
    def cuda_streams_in_use(self) -> int:
        """How many lanes (CUDA streams, each with its own graphs) concurrent callers have needed so far."""
        return len(self._lanes.lanes) if self._lanes is not None else 0

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        return self.execute_parts([inputs], outputs)

    def execute_parts(self, parts: Sequence[Mapping[str, Array]], outputs: Sequence[str]) -> dict[str, Array]:
        """Several requests' validated inputs as one batch, rows in order (the server's hook for a dynamic batch).
        With CUDA graphs each request's rows are copied once, straight into the lane's pinned buffers."""
        if self._function is None:
            raise UnavailableError(f"model '{self.spec.name}': the engine is closed")
        try:
            with torch.inference_mode(), self._on_device():
                if self._lanes is not None:
                    return self._execute_graph(self._lanes, parts, outputs)
                inputs = parts[0] if len(parts) == 1 else {name: join_rows([part[name] for part in parts])
                                                           for name in parts[0]}
                tensors = [self._input(name, inputs.get(name)) for name in self._order]
                return self._collect(self._call(tensors), outputs)
        except KilnError:
            raise
        except Exception as exc:  # anything torch raises while running the model
            raise torch_failure(self.spec, exc) from exc

    def close(self) -> None:
        if self._lanes is not None:
            for lane in self._lanes.lanes:
                lane.graphs.close()
            self._lanes = None
        self._function = None
        if self.device.type == "cuda":
            # Hand the blocks the weights and graphs held back to the driver, for other models and processes.
            torch.cuda.empty_cache()

    def _call(self, tensors: Tensors) -> object:
        function = self._function
        if function is None:
            raise UnavailableError(f"model '{self.spec.name}': the engine is closed")
        lock = _COMPILED_CALLS if self._compiled else contextlib.nullcontext()
        if self._compiled and self.spec.batching:
            # One graph for every batch size (but 1, which torch specialises): with a graph per size, the
            # recompile limit (8) would leave larger models' other sizes running uncompiled, and each size would
            # be compiled (or found in the cache) at load.
            for tensor in tensors:
                if tensor is not None:
                    torch._dynamo.maybe_mark_dynamic(tensor, 0)
        with lock:
            if self._dict_input:
                return function({name: t for name, t in zip(self._order, tensors, strict=True) if t is not None})
            return function(*tensors)

    def _input(self, name: str, array: Array | None) -> torch.Tensor | None:
        if array is None:  # an optional input the request left out
            return None
        if isinstance(array, torch.Tensor):  # a caller's tensor (infer() keeps them): no host round trip
            return self._convert(self._tensor_shape(name, array).to(self.device, non_blocking=True))
        return self._convert(to_device(host_tensor(self._to_model_shape(name, array)), self.device))

    def _tensor_shape(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        reshape = self.spec.input(name).reshape
        if reshape is None:
            return tensor
        lead = (tensor.shape[0],) if self.spec.batching else ()
        return tensor.reshape(lead + reshape)

    def _convert(self, tensor: torch.Tensor) -> torch.Tensor:
        dtype = self.settings.compute_dtype
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        if self.settings.channels_last and tensor.dim() == 4:
            tensor = tensor.contiguous(memory_format=torch.channels_last)
        return tensor

    def _to_model_shape(self, name: str, array: Array) -> Array:
        reshape = self.spec.input(name).reshape
        if reshape is None:
            return array
        lead = (array.shape[0],) if self.spec.batching else ()
        return array.reshape(lead + reshape)

    def _collect(self, result: object, wanted: Sequence[str]) -> dict[str, Array]:
        selected = select_outputs(self.spec, result, self._output_positions, wanted)
        arrays: dict[str, Array] = {}
        for name, value in selected.items():
            array = to_numpy(self.spec, self.spec.output(name), value, self._output_dtypes[name])
            arrays[name] = self._output_shape(name, array)
        return arrays

    def launch_parts(self, parts: Sequence[Mapping[str, Array]],
                     outputs: Sequence[str]) -> LaunchedBatch | None:
        """Queue the batch on a free lane's stream and return; None without CUDA graphs or a free lane."""
        lanes = self._lanes
        if self._function is None:
            raise UnavailableError(f"model '{self.spec.name}': the engine is closed")
        if lanes is None:
            return None
        lane = lanes.try_take()
        if lane is None:
            return None
        lane.graphs.lock.acquire()
        try:
            with torch.inference_mode(), self._on_device():
                hosts = self._start(lane, parts, outputs)
                lane.done.record(lane.stream)
        except BaseException as exc:
            lane.graphs.lock.release()
            lanes.give_back(lane)
            if isinstance(exc, KilnError):
                raise
            raise torch_failure(self.spec, exc) from exc
        return _LaunchedGraph(self, lanes, lane, hosts)

    def _execute_graph(self, lanes: LanePool[GraphLane], parts: Sequence[Mapping[str, Array]],
                       outputs: Sequence[str]) -> dict[str, Array]:
        with lanes.lane() as lane, lane.graphs.lock:
            hosts = self._start(lane, parts, outputs)
            # The lane's staging buffers and static outputs are reused by its next call: finish with them first.
            lane.stream.synchronize()
            return self._host_results(hosts)

    def _start(self, lane: GraphLane, parts: Sequence[Mapping[str, Array]],
               outputs: Sequence[str]) -> dict[str, torch.Tensor]:
        """Queue on the lane's stream: the inputs' copies in, the graph, the outputs' copies to pinned buffers. A
        batch of ``cuda_shared_stream_from_batch`` rows or more replays its graph on the model's shared stream
        instead, between its copies."""
        with _current_stream(lane.stream, self._device_index) as caller:
            sources = [self._source(lane, caller, name, parts) for name in self._order]
            batch = _rows(sources[0]) if self.spec.batching and sources else 0
            captured = lane.graphs.get(batch, functools.partial(self._static_inputs, lane, batch))
            shared = self._shared_stream
            compute = (lane.stream, shared) if shared is not None and batch >= self._shared_from else None
            result = lane.graphs.replay(captured, sources, compute)
            assert isinstance(result, dict)  # _graph_body's outputs, in the config's dtypes
            return {name: self._host_output(lane, name, result[name]) for name in outputs}

    def _host_results(self, hosts: Mapping[str, torch.Tensor]) -> dict[str, Array]:
        """The lane's pinned output buffers are reused by its next call: the caller gets its own copy."""
        return {name: self._output_shape(name, numpy_view(host).copy()) for name, host in hosts.items()}

    def _graph_body(self, tensors: Tensors) -> dict[str, torch.Tensor]:
        """What a CUDA graph records: the inputs, held in the config's dtypes, cast to the engine's compute dtype
        and layout; the model; every output cast back to its config dtype. Keeping the casts inside the graph
        makes the copies in and out plain memcpys, with no temporary tensors allocated per call."""
        converted = [None if tensor is None else self._convert(tensor) for tensor in tensors]
        result = self._call(converted)
        names = [tensor.name for tensor in self.spec.outputs]
        selected = select_outputs(self.spec, result, self._output_positions, names)
        outputs: dict[str, torch.Tensor] = {}
        for name, value in selected.items():
            target = self._output_dtypes[name]
            outputs[name] = checked_output(self.spec, self.spec.output(name), value, target).to(target)
        return outputs

    def _host_output(self, lane: GraphLane, name: str, value: torch.Tensor) -> torch.Tensor:
        """Start copying ``value`` into the lane's pinned buffer for output ``name``."""
        row_shape = tuple(value.shape[1:] if self.spec.batching else value.shape)
        staging = lane.host_outputs.get(name)
        if staging is None or staging.row_shape != row_shape:  # an output whose dims vary gets a new buffer
            staging = lane.host_outputs[name] = RowStaging(value.dtype, row_shape, batching=self.spec.batching,
                                                           max_rows=self.spec.max_batch_size, pinned=True)
        host = staging.rows(value.shape[0] if self.spec.batching else 1)
        host.copy_(value, non_blocking=True)
        return host

    def _source(self, lane: GraphLane, caller: torch.cuda.Stream, name: str,
                parts: Sequence[Mapping[str, Array]]) -> torch.Tensor | HostRows:
        """What the graph's static input ``name`` is copied from: the parts where they lie when each is in pinned
        shared memory (a worker's arena: pinned_host.py), else the lane's pinned buffer holding every part's rows,
        or, when some part is a tensor (read in place from CUDA shared memory), the parts joined where they lie.
        The lane's stream waits for the caller's, which made those tensors."""
        values = [part[name] for part in parts]
        if not any(isinstance(value, torch.Tensor) for value in values):
            arrays = [self._to_model_shape(name, value) for value in values]
            in_place = host_rows(arrays, self._input_numpy_dtypes[name], self.device)
            return in_place if in_place is not None else lane.staging[name].fill(arrays)
        if any(isinstance(value, torch.Tensor) and value.is_cuda for value in values):
            lane.stream.wait_stream(caller)
        joined = values[0] if len(values) == 1 else join_rows(values)
        assert isinstance(joined, torch.Tensor)
        return self._tensor_shape(name, joined)

    def _output_shape(self, name: str, array: Array) -> Array:
        """An output in the config's dims (a model whose output the config reshapes returns it in the model's)."""
        tensor = self.spec.output(name)
        if tensor.reshape is None:
            return array
        lead = (array.shape[0],) if self.spec.batching else ()
        return array.reshape(lead + tensor.dims)

    def _new_lane(self, index: int) -> GraphLane:
        stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        graphs = CudaGraphs(f"{self.spec.name}", self.device, self._graph_body)
        staging = {name: RowStaging(self._input_dtypes[name], _model_dims(self.spec.input(name)),
                                    batching=self.spec.batching, max_rows=self.spec.max_batch_size, pinned=True)
                   for name in self._order}
        return GraphLane(stream, graphs, staging)

    def _static_inputs(self, lane: GraphLane, batch: int) -> list[torch.Tensor]:
        """The inputs a graph for ``batch`` reads: the first ``batch`` rows of the lane's device buffers (a lane
        runs one graph at a time, so its graphs can share them)."""
        tensors: list[torch.Tensor] = []
        for name in self._order:
            buffer = lane.static_inputs.get(name)
            if buffer is None:
                shape = _model_dims(self.spec.input(name))
                full = (max(self.spec.max_batch_size, 1), *shape) if self.spec.batching else shape
                buffer = torch.zeros(full, dtype=self._input_dtypes[name], device=self.device)
                lane.static_inputs[name] = buffer
            tensors.append(buffer[:batch] if self.spec.batching else buffer)
        return tensors

    @property
    def graph_body(self) -> Callable[[Tensors], dict[str, torch.Tensor]]:
        """What each lane's CUDA graph records: inputs in the config's dtypes (from :meth:`zero_inputs`) in, the
        model, outputs in the config's dtypes out. For measuring what the GPU does with the engine's graphs."""
        return self._graph_body

    def zero_inputs(self, batch: int) -> list[torch.Tensor]:
        """Zeros for every input, in forward()'s order, the config's dtypes and the model's dims, on the engine's
        device: ``batch`` rows (ignored by a model without a batch dimension)."""
        tensors: list[torch.Tensor] = []
        for name in self._order:
            shape = _model_dims(self.spec.input(name))
            full = (batch, *shape) if self.spec.batching else shape
            tensors.append(torch.zeros(full, dtype=self._input_dtypes[name], device=self.device))
        return tensors

    def _warm_up(self) -> None:
        """Compile at load what calls will need (the largest batch's dynamic graph and batch 1's), so no request
        waits minutes for it. Skipped for inputs without fixed dims, which zeros cannot stand for."""
        inputs = [self.spec.input(name) for name in self._order]
        if any(t.optional or any(d < 1 for d in _model_dims(t)) for t in inputs):
            return
        largest = min(max(self.spec.max_batch_size, 1), WARM_UP_BATCH)
        sizes = sorted({largest, 1}, reverse=True) if self.spec.batching else [0]
        try:
            with torch.inference_mode(), self._on_device():
                for batch in sizes:
                    self._call([self._convert(tensor) for tensor in self.zero_inputs(batch)])
        except Exception as exc:  # a model that zeros upset still runs on real inputs, compiled on first use
            log.warning("model '%s': warming up the compiled model on zeros failed (%s: %s); it compiles on its "
                        "first calls instead", self.spec.name, type(exc).__name__, exc)

    def _check_compile_counts(self, before: CompileCounts, seconds: float) -> None:
        """Record what loading compiled; warn when a loaded cache left graphs to compile. Torch counts for the
        whole process, so a model compiling on another thread meanwhile is counted too."""
        self.compile_counts = compile_counts().since(before)
        cache = self.compile_cache
        if cache is not None and cache.status == "loaded" and self.compile_counts.misses:
            log.warning("model '%s': the compile cache did not hold %d of the graphs torch.compile needed (made by "
                        "another build of the model?); they were compiled anew (load took %.1f s)", self.spec.name,
                        self.compile_counts.misses, seconds)

    def _capture_listed(self) -> None:
        """Capture the listed batch sizes on the first lane at load, largest first; other lanes capture on first
        use. The lane's graphs share one memory pool: after the largest capture, each smaller one fits in blocks the
        pool already holds, where captures in rising order would each need slightly larger new blocks and leave the
        smaller ones unused."""
        assert self._lanes is not None
        sizes = sorted(self.settings.cuda_graph_batch_sizes, reverse=True) if self.spec.batching else [0]
        with torch.inference_mode(), self._on_device(), self._lanes.lane() as lane, \
                _current_stream(lane.stream, self._device_index), lane.graphs.lock:
            for batch in sizes:
                lane.graphs.get(batch, functools.partial(self._static_inputs, lane, batch))

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        # Switching only when another device is current: torch.cuda.device resolves its argument through Python
        # helpers that cost more than the rest of a graph lane's call under the GIL.
        if self.device.type != "cuda" or torch.cuda.current_device() == self._device_index:
            yield
            return
        with torch.cuda.device(self.device):
            yield


@contextlib.contextmanager
def _current_stream(stream: torch.cuda.Stream, device_index: int) -> Iterator[torch.cuda.Stream]:
    """Make ``stream`` current on its device for the block; yield the stream that was current before (the caller's).
    What torch.cuda.stream does, without the current-device lookups it makes on every entry."""
    previous = torch.cuda.current_stream(device_index)
    torch.cuda.set_stream(stream)
    try:
        yield previous
    finally:
        torch.cuda.set_stream(previous)


def _rows(source: torch.Tensor | HostRows) -> int:
    return source.rows if isinstance(source, HostRows) else int(source.shape[0])


class _LaunchedGraph:
    """A batch queued on a lane (TorchEngine.launch_parts), holding the lane until its outputs are collected."""

    def __init__(self, engine: TorchEngine, lanes: LanePool[GraphLane], lane: GraphLane,
                 hosts: dict[str, torch.Tensor]) -> None:
        self._engine = engine
        self._lanes = lanes
        self._lane: GraphLane | None = lane
        self._hosts = hosts
        self._done = False

    def wait(self) -> None:
        self._synchronize(self._held())
        self._done = True

    def collect(self) -> dict[str, Array]:
        lane = self._held()
        self._lane = None
        try:
            if not self._done:  # after wait(), not again: synchronizing gives up the GIL, and the loop would wait
                self._synchronize(lane)  # to get it back from whichever thread took it
            return self._engine._host_results(self._hosts)
        finally:
            lane.graphs.lock.release()
            self._lanes.give_back(lane)

    def _held(self) -> GraphLane:
        if self._lane is None:
            raise InternalError(f"model '{self._engine.spec.name}': the batch's outputs were already collected")
        return self._lane

    def _synchronize(self, lane: GraphLane) -> None:
        try:
            lane.done.synchronize()
        except Exception as exc:  # a fault on the device surfaces here
            raise torch_failure(self._engine.spec, exc) from exc


def torch_failure(spec: ModelSpec, exc: BaseException) -> InternalError:
    """What the caller sees when PyTorch itself fails (not a request's mistake)."""
    return InternalError(f"model '{spec.name}': PyTorch failed: {exc}")


def join_rows(values: Sequence[Any]) -> Any:
    """Requests' rows of one input as one batch: numpy when every part is numpy, else a tensor on the device of
    the first tensor part (numpy parts are copied there)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return np.concatenate(values)
    device = tensors[0].device
    return torch.cat([v.to(device) if isinstance(v, torch.Tensor) else host_tensor(v).to(device) for v in values])


def _device(spec: ModelSpec, options: EngineOptions) -> torch.device:
    if options.kind != "gpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UnavailableError(f"model '{spec.name}': a GPU instance was requested, but this PyTorch "
                               f"({torch.__version__}) sees no CUDA device; install a CUDA build of torch on a "
                               f"machine with a GPU, or use KIND_CPU")
    count = torch.cuda.device_count()
    if not 0 <= options.device_id < count:
        raise UnavailableError(f"model '{spec.name}': GPU {options.device_id} was requested, but PyTorch sees "
                               f"{count} GPU(s) (0..{count - 1}); fix the instance group's gpus")
    return torch.device("cuda", options.device_id)


def _check_format(spec: ModelSpec, found: ModelFormat, settings: TorchSettings) -> None:
    name = spec.name
    if settings.compile_mode != "none" and found is ModelFormat.TORCHSCRIPT:
        raise ConfigError(f"model '{name}': parameter '{COMPILE_MODE}' is '{settings.compile_mode}', but "
                          f"torch.compile cannot compile TorchScript; export the model with torch.export.save "
                          f"(model.pt2, platform torch_aoti), or set {COMPILE_MODE}: none")
    if settings.compile_mode != "none" and found is ModelFormat.AOTI:
        raise ConfigError(f"model '{name}': parameter '{COMPILE_MODE}' is '{settings.compile_mode}', but the model "
                          f"is an AOTInductor package, compiled ahead of time already; set {COMPILE_MODE}: none")
    if settings.channels_last and found is ModelFormat.AOTI:
        raise ConfigError(f"model '{name}': parameter '{CHANNELS_LAST}' is 'true', but an AOTInductor package's "
                          f"memory layouts are fixed when it is compiled; compile it from a channels_last module "
                          f"and inputs instead, and set {CHANNELS_LAST}: false")


def _check_static(spec: ModelSpec) -> None:
    for tensor in spec.inputs:
        if tensor.optional:
            raise ConfigError(f"model '{spec.name}': input '{tensor.name}' is optional, but '{CUDA_GRAPHS}' is "
                              f"'true'; a CUDA graph needs every input on every run (make it required or turn "
                              f"CUDA graphs off)")
        dims = _model_dims(tensor)
        if any(d < 1 for d in dims):
            raise ConfigError(f"model '{spec.name}': input '{tensor.name}' has variable dims {list(dims)}, but "
                              f"'{CUDA_GRAPHS}' is 'true'; a CUDA graph has fixed shapes, so every dim but the "
                              f"batch dimension must be fixed")


def _model_dims(tensor: TensorSpec) -> tuple[int, ...]:
    return tensor.reshape if tensor.reshape is not None else tensor.dims


def _argument_order(spec: ModelSpec, loaded: LoadedModel) -> list[str]:
    """The config's input names in the order forward() takes them (config order for one dict argument)."""
    if loaded.dict_input:
        return [t.name for t in spec.inputs]
    positions = input_positions(spec, loaded)
    return sorted(positions, key=positions.__getitem__)


def _check_device(spec: ModelSpec, loaded: LoadedModel, device: torch.device) -> None:
    if loaded.device_key and loaded.device_key != device.type:
        raise ConfigError(f"model '{spec.name}': the AOTInductor package was compiled for '{loaded.device_key}', "
                          f"but this instance runs on '{device.type}'; compile a package for that device or change "
                          f"the instance group's kind")


def _apply_threads(settings: TorchSettings, options: EngineOptions) -> None:
    """torch.set_num_threads is process-wide: the last engine loaded sets it for every CPU model of the process."""
    threads = options.intra_op_threads or settings.num_threads
    if options.kind != "gpu" and threads and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _prepare(loaded: LoadedModel, settings: TorchSettings) -> Callable[..., Any]:
    module = loaded.module
    if module is None:  # an AOTInductor package: dtype and layout were fixed when it was compiled
        return loaded.function
    if settings.compute_dtype is not None:
        module = module.to(settings.compute_dtype)
    if settings.channels_last:
        # Module.to accepts memory_format at run time; torch's overloads do not list it.
        module = module.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    if settings.compile_mode != "none":
        # Inductor, imported by the first compiled call otherwise, imports torch.utils.mkldnn, whose TorchScript
        # classes warn that `torch.jit.script_method` is deprecated: nothing about this model.
        with ignoring(r"`torch\.jit\.script_method` is deprecated", DeprecationWarning):
            importlib.import_module("torch._inductor.compile_fx")
        return torch.compile(module, mode=settings.compile_mode)
    return module
