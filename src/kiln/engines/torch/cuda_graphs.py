"""One CUDA graph per batch size: static input buffers, captured once, then copy in, replay, read out.

A replay reuses the same input and output buffers, so two replays must never overlap: callers hold ``lock`` from
copying inputs in until they have copied the outputs out. All graphs share one memory pool, which is safe because
the lock also keeps different batch sizes from running at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kiln.engines.torch.pinned_host import HostRows
from kiln.errors import InternalError

WARMUP_RUNS = 3  # runs before capture, so lazy initialisation (cuBLAS handles, autotuning) stays out of the graph

# Warm-up and capture run on one side stream per device, shared by every engine of the process: cuBLAS keeps a
# workspace for each stream it has run on for the life of the process (32 MiB on recent GPUs), so a new stream per
# capture would leave one behind each time. Captures take turns on it.
_CAPTURE_LOCK = threading.Lock()
_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}
# Large batches of a model replay on one stream per device, shared by its instances' lanes (shared_compute_stream).
_SHARED_STREAMS_LOCK = threading.Lock()
_SHARED_STREAMS: dict[tuple[str, int], SharedStream] = {}


@dataclass(frozen=True)
class SharedStream:
    """A stream several lanes replay graphs on, and the lock that keeps one lane's wait, replay and event together
    (another lane's batch queued between them would delay this one's copies out by its whole graph)."""

    stream: torch.cuda.Stream
    lock: threading.Lock


@dataclass
class CapturedGraph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: object  # forward()'s result, made of tensors the graph writes on every replay


class CudaGraphs:
    """The graphs of one engine, keyed by batch size (0 for a model without a batch dimension)."""

    def __init__(self, model: str, device: torch.device, run: Callable[[Sequence[torch.Tensor]], object]) -> None:
        self.lock = threading.Lock()
        self._model = model
        self._device = device
        self._run = run
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[int, CapturedGraph] = {}

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes captured so far."""
        return tuple(sorted(self._graphs))

    @property
    def capture_order(self) -> tuple[int, ...]:
        """The batch sizes captured so far, in the order they were captured."""
        return tuple(self._graphs)

    def get(self, batch: int, make_inputs: Callable[[], list[torch.Tensor]]) -> CapturedGraph:
        """The graph for ``batch``, captured now over fresh static inputs if it is new. Call with ``lock`` held."""
        captured = self._graphs.get(batch)
        if captured is None:
            captured = self._capture(batch, make_inputs())
            self._graphs[batch] = captured
        return captured

    def replay(self, captured: CapturedGraph, inputs: Sequence[torch.Tensor | HostRows],
               compute: tuple[torch.cuda.Stream, SharedStream] | None = None) -> object:
        """Copy ``inputs`` (tensors, or rows in pinned shared memory) into the static buffers and replay, all on the
        current stream; or, given ``compute`` (the current stream, the shared stream to replay on), copy on the
        current stream, replay on the shared one once the copies are done, and leave the current stream waiting for
        the replay, so what the caller queues next (its copies out) follows it. Call with ``lock`` held, and read
        the returned outputs before releasing it."""
        for static, value in zip(captured.inputs, inputs, strict=True):
            if isinstance(value, HostRows):
                value.copy_into(static)
            else:
                static.copy_(value, non_blocking=True)
        if compute is None:
            captured.graph.replay()
            return captured.outputs
        current, shared = compute
        with shared.lock:
            shared.stream.wait_stream(current)
            torch.cuda.set_stream(shared.stream)
            try:
                captured.graph.replay()
            finally:
                torch.cuda.set_stream(current)
            replayed = shared.stream.record_event()
        current.wait_event(replayed)
        return captured.outputs

    def close(self) -> None:
        with self.lock:
            self._graphs.clear()

    def _capture(self, batch: int, inputs: list[torch.Tensor]) -> CapturedGraph:
        try:
            with _CAPTURE_LOCK:
                side = _capture_stream(self._device)
                side.wait_stream(torch.cuda.current_stream(self._device))
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_RUNS):
                        self._run(inputs)
                graph = torch.cuda.CUDAGraph()
                # thread_local: other models' threads may use CUDA meanwhile; only this thread must be capturable.
                with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
                    outputs = self._run(inputs)
                torch.cuda.current_stream(self._device).wait_stream(side)
        except RuntimeError as exc:
            raise InternalError(f"model '{self._model}': capturing a CUDA graph for batch size {batch} failed: {exc}; "
                                f"models that synchronize with the host or change shapes inside forward() cannot be "
                                f"captured (set cuda_graphs: false)") from exc
        return CapturedGraph(graph, inputs, outputs)


def shared_compute_stream(model: str, device: torch.device) -> SharedStream:
    """The one stream on ``device`` on which every instance of ``model`` replays its large batches' graphs. Queued
    on one stream, the GPU runs them one after another, so each finishes as early as it can and its instance can
    answer and stage its next batch while the GPU runs the other's; side by side, both would finish late."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _SHARED_STREAMS_LOCK:
        shared = _SHARED_STREAMS.get((model, index))
        if shared is None:
            stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            shared = _SHARED_STREAMS[(model, index)] = SharedStream(stream, threading.Lock())
        return shared


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _CAPTURE_STREAMS.get(index)
    if stream is None:
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        _CAPTURE_STREAMS[index] = stream
    return stream
