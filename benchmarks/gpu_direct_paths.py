"""kiln's direct engine next to plain PyTorch doing the same work, batch-1 ResNet-50 calls from N threads (GPU).

Rows, each a timed window after a warm-up, requests/s with p50/p99 per call:

* ``kiln engine.infer`` with a numpy image, at concurrency 1, 8 and 16, once more at 16 with a 0.5 ms GIL switch
  interval and, with ``--streams16-repo``, with ``cuda_streams: 16`` (a lane per thread);
* plain PyTorch, the best direct mode of the reference measurements: each thread owns a CUDA stream, a CUDA graph
  of the same module (fp16, channels-last) and pinned input and output tensors; per call one non-blocking copy in
  (casting fp32 to fp16), a replay, one copy out, a stream synchronize; then the same with the numpy image copied
  into the pinned tensor first, as kiln must.

The gap between the two is what kiln's own per-call work costs. Run on a GPU host with a repository holding a
built resnet50 (``kiln build ... --backend torch --device cuda --precision fp16 --channels-last``):

    python3 benchmarks/gpu_direct_paths.py --repo /tmp/gpu --output results/gpu_direct_paths.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import Array, describe, header

import kiln

Call = Callable[[], object]


def drive(results: dict[str, Any], name: str, make_call: Callable[[int], Call], concurrency: int,
          seconds: float, warmup: float) -> None:
    """Run ``concurrency`` threads, each repeating its own call, and record the rate of the timed window."""
    calls = [make_call(i) for i in range(concurrency)]
    counts = [0] * concurrency
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    stop = threading.Event()

    def worker(i: int) -> None:
        call = calls[i]
        while not stop.is_set():
            start = time.perf_counter()
            call()
            latencies[i].append(time.perf_counter() - start)
            counts[i] += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    time.sleep(warmup)
    before = sum(counts)
    for each in latencies:
        each.clear()
    started = time.perf_counter()
    time.sleep(seconds)
    done = sum(counts) - before
    elapsed = time.perf_counter() - started
    stop.set()
    for thread in threads:
        thread.join()
    ordered = sorted(x for each in latencies for x in each)
    row = {"concurrency": concurrency, "requests_per_s": done / elapsed,
           "p50_ms": 1e3 * ordered[len(ordered) // 2], "p99_ms": 1e3 * ordered[int(len(ordered) * 0.99)]}
    results[name] = row
    print(f"{name:62s} {row['requests_per_s']:8,.0f}/s  p50 {row['p50_ms']:.2f} ms  p99 {row['p99_ms']:.2f} ms",
          flush=True)


def plain_call(module: Callable[..., Any], image: Array, numpy_copy: bool) -> Call:
    """One thread's plain-PyTorch caller: its own stream, graph and pinned buffers."""
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    static = torch.zeros(image.shape, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
    pinned = torch.from_numpy(image.copy()).pin_memory()
    pinned_view = pinned.numpy()
    with torch.inference_mode():
        with torch.cuda.stream(stream):
            for _ in range(3):
                module(static)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            result = module(static)
    output = result[0] if isinstance(result, (tuple, list)) else result
    host = torch.empty(output.shape, dtype=output.dtype, pin_memory=True)
    source = image.copy()

    def call() -> object:
        with torch.inference_mode(), torch.cuda.stream(stream):
            if numpy_copy:
                np.copyto(pinned_view, source)
            static.copy_(pinned, non_blocking=True)
            graph.replay()
            host.copy_(output, non_blocking=True)
            stream.synchronize()
        return host.numpy().astype(np.float32)

    return call


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, required=True, help="a repository with the built resnet50")
    parser.add_argument("--streams16-repo", type=Path, help="the same with parameter cuda_streams: 16")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    print(header(describe("kiln's direct engine next to plain PyTorch, batch-1 ResNet-50 calls",
                          gpu=f"{torch.cuda.get_device_name()}, torch {torch.__version__}")), flush=True)
    results: dict[str, Any] = {}

    def run(name: str, make_call: Callable[[int], Call], concurrency: int) -> None:
        drive(results, name, make_call, concurrency, args.seconds, args.warmup)
        if args.output:
            args.output.write_text(json.dumps(results, indent=1))

    engine = kiln.load(args.repo / "resnet50", kind="gpu")
    spec = engine.spec.inputs[0]  # one image: its name and dims
    image = np.random.default_rng(0).random((1, *spec.dims), dtype=np.float32)

    def kiln_call(engine: Any) -> Callable[[int], Call]:
        def make(_: int) -> Call:
            source = image.copy()  # each thread its own array, as separate callers would have
            return lambda: engine.infer({spec.name: source})
        return make

    for concurrency in (1, 8, 16):
        run(f"kiln engine.infer, numpy, c={concurrency}", kiln_call(engine), concurrency)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    run("kiln engine.infer, numpy, c=16, GIL switch interval 0.5 ms", kiln_call(engine), 16)
    sys.setswitchinterval(interval)
    if args.streams16_repo:
        wide = kiln.load(args.streams16_repo / "resnet50", kind="gpu")
        run("kiln engine.infer, numpy, c=16, cuda_streams 16", kiln_call(wide), 16)
        wide.close()

    module: Callable[..., Any] = engine._function  # type: ignore[attr-defined]  # the prepared fp16 module
    capture = threading.Lock()  # captures take turns; replays run freely

    def plain(numpy_copy: bool) -> Callable[[int], Call]:
        def make(_: int) -> Call:
            with capture:
                return plain_call(module, image, numpy_copy)
        return make

    for concurrency in (1, 8, 16):
        run(f"plain PyTorch, graph and stream per thread, c={concurrency}", plain(False), concurrency)
    run("plain PyTorch, graph and stream per thread, numpy copied in, c=16", plain(True), 16)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
