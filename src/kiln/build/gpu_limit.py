"""The GPU's own limit for a built engine: rows per second when batches are queued from 1-2 CUDA streams with no
server around them, so that what a server or a direct caller reaches can be read against it.

Each stream (a lane) owns a CUDA graph of the function for one batch size, its device inputs, and pinned host
buffers for its inputs and outputs. One thread queues batches round-robin over the lanes, never waiting on the
host, and times the whole run, so the figure is what the GPU and its copy engines give for that layout. Modes:

* ``copies``: each batch copies its inputs in, replays, copies its outputs out, all on its lane's stream (what the
  PyTorch engine's lanes do); the build reports this one;
* ``one compute stream``: the copies stay on each lane's stream, the replays all go to one shared stream, each
  after its own copy in: the GPU runs graphs one after another while copies overlap them;
* ``graph only``: replays on the lanes' streams, no copies: what interleaving the kernels of K graphs costs or
  gains.

benchmarks/gpu_streams.py prints every mode for several batch sizes and stream counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

MODES = ("copies", "one compute stream", "graph only")
REPORTED_MODE = "copies"
STREAMS = (1, 2)
SECONDS = 1.0  # per figure: long enough that queueing thousands of replays evens out
WARMUP_RUNS = 3


@dataclass
class Lane:
    stream: torch.cuda.Stream
    graph: torch.cuda.CUDAGraph
    device_inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    host_inputs: list[torch.Tensor]
    host_outputs: list[torch.Tensor]
    copied: torch.cuda.Event
    computed: torch.cuda.Event


@dataclass(frozen=True)
class LimitFigure:
    batch_size: int
    streams: int
    rows_per_s: float
    ms_per_batch: float

    def as_dict(self) -> dict[str, object]:
        return {"batch_size": self.batch_size, "streams": self.streams, "rows_per_s": round(self.rows_per_s, 1),
                "ms_per_batch": round(self.ms_per_batch, 4)}


def make_lane(run: Callable[[Sequence[torch.Tensor]], object], device_inputs: list[torch.Tensor]) -> Lane:
    """A lane replaying ``run(device_inputs)`` from a graph captured on a stream of its own."""
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    with torch.inference_mode():
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                run(device_inputs)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            outputs = output_tensors(run(device_inputs))
    host_inputs = [torch.empty_like(t, device="cpu", pin_memory=True) for t in device_inputs]
    host_outputs = [torch.empty_like(t, device="cpu", pin_memory=True) for t in outputs]
    return Lane(stream, graph, device_inputs, outputs, host_inputs, host_outputs,
                torch.cuda.Event(), torch.cuda.Event())  # type: ignore[no-untyped-call]


def output_tensors(result: object) -> list[torch.Tensor]:
    """The tensors a function returned: one, a tuple or list of them, or a dict's values."""
    if isinstance(result, torch.Tensor):
        return [result]
    values = list(result.values()) if isinstance(result, Mapping) else result
    if not isinstance(values, (tuple, list)):
        raise TypeError(f"expected a tensor, a tuple or list of tensors or a dict of them, not {type(result)}")
    return [value for value in values if isinstance(value, torch.Tensor)]


def queue_batch(lane: Lane, mode: str, compute: torch.cuda.Stream) -> None:
    with torch.cuda.stream(lane.stream):
        if mode == "graph only":
            lane.graph.replay()
            return
        for device, host in zip(lane.device_inputs, lane.host_inputs, strict=True):
            device.copy_(host, non_blocking=True)
        if mode == "copies":
            lane.graph.replay()
        else:
            lane.copied.record(lane.stream)
            compute.wait_event(lane.copied)
            with torch.cuda.stream(compute):
                lane.graph.replay()
            lane.computed.record(compute)
            lane.stream.wait_event(lane.computed)
        for host, output in zip(lane.host_outputs, lane.outputs, strict=True):
            host.copy_(output, non_blocking=True)


def measure(lanes: Sequence[Lane], mode: str, compute: torch.cuda.Stream, seconds: float) -> tuple[int, float]:
    """Batches queued round-robin for about ``seconds``; the count and the time until all of them were done."""
    for lane in list(lanes) * WARMUP_RUNS:
        queue_batch(lane, mode, compute)
    torch.cuda.synchronize()
    started = time.perf_counter()
    stop = started + seconds
    count = 0
    while time.perf_counter() < stop:
        for lane in lanes:
            queue_batch(lane, mode, compute)
        count += len(lanes)
    torch.cuda.synchronize()
    return count, time.perf_counter() - started


def gpu_limit(run: Callable[[Sequence[torch.Tensor]], object], make_inputs: Callable[[int], list[torch.Tensor]],
              batch_sizes: Sequence[int], streams: Sequence[int] = STREAMS, seconds: float = SECONDS,
              mode: str = REPORTED_MODE) -> list[LimitFigure]:
    """One figure per batch size and stream count: ``run`` captured on each lane over ``make_inputs(batch)``
    (device tensors; batch 0 for a model without a batch dimension, whose runs count one row each)."""
    compute = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    figures = []
    for batch in batch_sizes:
        for count in streams:
            lanes = [make_lane(run, make_inputs(batch)) for _ in range(count)]
            batches, elapsed = measure(lanes, mode, compute, seconds)
            figures.append(LimitFigure(batch, count, batches * max(batch, 1) / elapsed, 1000 * elapsed / batches))
            del lanes
            torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the lanes' graph pools go back to the driver
    return figures


def engine_gpu_limit(engine: Any, batch_sizes: Sequence[int], seconds: float = SECONDS) -> dict[str, Any]:
    """The report's ``gpu_limit``: a PyTorch engine's graph body (inputs in the config's dtypes, casts and model
    in the graph) measured in ``copies`` mode from 1 and 2 streams (1 for an AOTInductor package); or why it was not
    measured."""
    from kiln.engines.torch import TorchEngine
    from kiln.engines.torch.loading import ModelFormat
    from kiln.errors import KilnError

    engine = getattr(engine, "engine", engine)  # a batching engine wraps the one that runs
    if not isinstance(engine, TorchEngine):
        return {"skipped": "measured for the torch backend's engines only"}
    if engine.device.type != "cuda":
        return {"skipped": "the engine runs on the CPU"}
    sizes = list(batch_sizes) if engine.spec.batching else [0]
    # An AOTInductor package may keep buffers between runs, so the engine never replays it on two streams at once.
    streams = (1,) if engine.format is ModelFormat.AOTI else STREAMS
    try:
        figures = gpu_limit(engine.graph_body, engine.zero_inputs, sizes, streams, seconds)
    except (RuntimeError, KilnError) as exc:  # a model CUDA graphs cannot capture (it syncs with the host, say)
        return {"skipped": f"its graphs could not be captured: {exc}"}
    return {"mode": f"{REPORTED_MODE}: inputs in, graph replay, outputs out, on each stream; no server",
            "seconds_per_figure": seconds, "figures": [figure.as_dict() for figure in figures]}
