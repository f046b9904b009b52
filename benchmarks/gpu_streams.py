"""What the GPU itself gives for batches of B images fed from K CUDA streams at once, with no server around it.

Each stream owns a CUDA graph of the built module (FP16, channels-last) for batch B, a device input, and pinned
host buffers for its input (FP16) and output. One thread queues batches round-robin over the streams, never
waiting on the host, and times the whole run, so the figure is the GPU's (and copy engines') limit for that
layout. Modes:

* ``copies``: each batch copies its input in, replays, copies its output out, all on its stream (kiln's lanes);
* ``one compute stream``: the copies stay on each stream, the replays all go to one shared stream, ordered after
  their own copy in by events: the GPU runs graphs one after another while copies overlap them;
* ``graph only``: replays on the K streams, no copies: how much interleaving kernels of K graphs costs or gains.

    python3 benchmarks/gpu_streams.py --repo /tmp/gpu [--batches 16,32] [--streams 1,2,4] [--seconds 1.5]

The repository holds the built resnet50 (kiln build ... --backend torch --device cuda --precision fp16
--channels-last). Prints one line per layout: images/s and ms per batch.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _common import describe, header, int_list

import kiln


@dataclass
class Lane:
    stream: torch.cuda.Stream
    graph: torch.cuda.CUDAGraph
    device_input: torch.Tensor
    output: torch.Tensor
    host_input: torch.Tensor
    host_output: torch.Tensor
    copied: torch.cuda.Event
    computed: torch.cuda.Event


def make_lane(module: Callable[..., Any], batch: int, dims: tuple[int, ...]) -> Lane:
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    device_input = torch.randn(batch, *dims, device="cuda", dtype=torch.float16)
    device_input = device_input.contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        with torch.cuda.stream(stream):
            for _ in range(3):
                module(device_input)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            result = module(device_input)
    output = result[0] if isinstance(result, (tuple, list)) else result
    host_input = torch.randn(batch, *dims, dtype=torch.float16).pin_memory()
    host_output = torch.empty(output.shape, dtype=output.dtype, pin_memory=True)
    return Lane(stream, graph, device_input, output, host_input, host_output,
                torch.cuda.Event(), torch.cuda.Event())  # type: ignore[no-untyped-call]


def queue_batch(lane: Lane, mode: str, compute: torch.cuda.Stream) -> None:
    with torch.cuda.stream(lane.stream):
        if mode == "graph only":
            lane.graph.replay()
            return
        lane.device_input.copy_(lane.host_input, non_blocking=True)
        if mode == "copies":
            lane.graph.replay()
        else:
            lane.copied.record(lane.stream)
            compute.wait_event(lane.copied)
            with torch.cuda.stream(compute):
                lane.graph.replay()
            lane.computed.record(compute)
            lane.stream.wait_event(lane.computed)
        lane.host_output.copy_(lane.output, non_blocking=True)


def measure(lanes: list[Lane], mode: str, compute: torch.cuda.Stream, seconds: float) -> tuple[int, float]:
    """Batches queued round-robin for about ``seconds``; returns the count and the time until all are done."""
    for lane in lanes * 3:  # warm-up
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, required=True, help="a repository with the built resnet50")
    parser.add_argument("--batches", default="16,32")
    parser.add_argument("--streams", default="1,2,4")
    parser.add_argument("--seconds", type=float, default=1.5)
    args = parser.parse_args(argv)
    engine = kiln.load(args.repo / "resnet50", kind="gpu")
    module: Callable[..., Any] = engine._function  # type: ignore[attr-defined]  # the prepared fp16 module
    dims = tuple(engine.spec.inputs[0].dims)  # one image: channels, height, width
    compute = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    print(header(describe("The GPU's own limit: batches queued from K CUDA streams, no server",
                          gpu=f"{torch.cuda.get_device_name()}, torch {torch.__version__}")), flush=True)
    for batch in int_list(args.batches):
        for streams in int_list(args.streams):
            lanes = [make_lane(module, batch, dims) for _ in range(streams)]
            for mode in ("copies", "one compute stream", "graph only"):
                count, elapsed = measure(lanes, mode, compute, args.seconds)
                print(f"batch {batch:3d}, {streams} streams, {mode:18s}: {count * batch / elapsed:8,.0f} images/s, "
                      f"{1000 * elapsed / count:.3f} ms per batch", flush=True)
            del lanes
            torch.cuda.synchronize()
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
