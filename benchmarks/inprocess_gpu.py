"""One in-process serving measurement on a GPU model folder, with the config edited per variant: a kiln.Server in
this process, N coroutines calling ``await server.infer`` on one event loop for a fixed time. Prints images/s, the
average batch and the server's phase times per request. Quicker to run than gpu_serving.py (no bench runner, no
stability windows), for A/B comparisons of one change within one device session.

    python benchmarks/inprocess_gpu.py REPO --concurrency 64 --instances 2 --preferred 8,32 [--fp16-inputs]
        [--launch auto|off] [--streams N] [--copy-threads N] [--parallel-copy-mb MB] [--switch-interval-us US]
        [--gpu-timing] [--shared-stream-from N|off]

REPO holds the built ``resnet50`` (kiln build ... --device cuda); the edited copy goes under /tmp.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _common import Array, describe, header

from kiln.config.parse import config_to_text, read_config
from kiln.engines.torch import staging
from kiln.server import InferRequest, InputTensor, Server, ServerOptions
from kiln.tensor import DataType
from kiln.v2._generated import model_config_pb2 as pb

MODEL = "resnet50"


def _variant(built: Path, root: Path, instances: int, preferred: list[int], fp16: bool, launch: str) -> Path:
    repo = root / "repo"
    shutil.copytree(built, repo)
    config = read_config(repo / MODEL)
    assert config is not None
    del config.instance_group[:]
    config.instance_group.add(kind=pb.ModelInstanceGroup.KIND_GPU, count=instances)
    config.dynamic_batching.preferred_batch_size[:] = preferred
    if fp16:
        for tensor in config.input:
            tensor.data_type = pb.TYPE_FP16
    config.parameters["launch_execution"].string_value = launch
    (repo / MODEL / "config.pbtxt").write_text(config_to_text(config))
    return repo


async def _drive(server: Server, name: str, images: list[Array], datatype: DataType, seconds: float) -> int:
    done = 0
    stop = time.perf_counter() + seconds

    async def client(image: Array) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await server.infer(InferRequest(MODEL, [InputTensor(name, datatype, image.shape, image)]))
            done += 1

    await asyncio.gather(*(client(image) for image in images))
    return done


class _GpuTiming:
    """CUDA events on each batch's lane stream, around its copies in, graph and copies out: how long the GPU took
    per batch, and for how much of the measured window some batch was on the GPU (the union over lanes)."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, Any]] = []
        self.recording = False

    def install(self) -> None:
        import torch

        from kiln.engines.torch.engine import TorchEngine

        start = TorchEngine._start

        def timed(engine: TorchEngine, lane: Any, *args: Any) -> Any:
            if not self.recording:
                return start(engine, lane, *args)
            began = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            began.record(lane.stream)
            hosts = start(engine, lane, *args)
            ended = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            ended.record(lane.stream)
            self.events.append((began, ended))
            return hosts

        TorchEngine._start = timed  # type: ignore[method-assign,assignment]

    def summary(self) -> str:
        import torch

        torch.cuda.synchronize()
        if not self.events:
            return "gpu timing: no batches"
        origin = self.events[0][0]
        spans = sorted((origin.elapsed_time(b), origin.elapsed_time(e)) for b, e in self.events)
        busy, reach = 0.0, float("-inf")
        for begin, end in spans:  # the union of the spans
            if end > reach:
                busy += end - max(begin, reach)
                reach = end
        window = max(end for _, end in spans) - spans[0][0]
        per_batch = sum(end - begin for begin, end in spans) / len(spans)
        return (f"gpu per batch {per_batch:.2f} ms (launch to done on its stream), some batch on the GPU "
                f"{100 * busy / window:.0f}% of the window")


def _graphs(server: Server) -> tuple[str, int]:
    """Lanes in use per instance, and CUDA graphs captured over all instances' lanes."""
    engines = [engine for version in server._models[MODEL].versions.values() if version.loaded is not None
               for engine in version.loaded.engines]
    lanes = "+".join(str(getattr(engine, "cuda_streams_in_use", 0)) for engine in engines)
    return lanes, sum(getattr(engine, "cuda_graph_count", 0) for engine in engines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("repo", type=Path)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before the measured window")
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--preferred", default="", help="preferred batch sizes, e.g. 16,32 (default: none)")
    parser.add_argument("--fp16-inputs", action="store_true")
    parser.add_argument("--launch", choices=("auto", "off"), default="auto",
                        help="launch_execution: batches launched from the event loop (auto) or run by workers (off)")
    parser.add_argument("--streams", type=int, default=0, help="cuda_streams per instance (default: the config's)")
    parser.add_argument("--copy-threads", type=int, default=0,
                        help="threads sharing a large staging copy (default: kiln's, staging.COPY_THREADS)")
    parser.add_argument("--parallel-copy-mb", type=float, default=0.0,
                        help="staging copies from this size are shared (default: kiln's, PARALLEL_COPY_BYTES)")
    parser.add_argument("--gpu-timing", action="store_true",
                        help="time each batch on its stream with CUDA events and print the GPU's busy share")
    parser.add_argument("--shared-stream-from", default="",
                        help="cuda_shared_stream_from_batch: batches this large replay on the model's shared stream "
                             "(a batch size or off; default: the config's)")
    parser.add_argument("--switch-interval-us", type=int, default=0,
                        help="sys.setswitchinterval for the run (default: Python's 5,000 us): how soon the waiter "
                             "thread gets the GIL back from a busy event loop")
    args = parser.parse_args(argv)
    print(header(describe("In-process serving of a built GPU model", repo=str(args.repo))), flush=True)
    if args.switch_interval_us:
        sys.setswitchinterval(args.switch_interval_us / 1e6)
    if args.copy_threads:
        staging.COPY_THREADS = args.copy_threads
    if args.parallel_copy_mb:
        staging.PARALLEL_COPY_BYTES = int(args.parallel_copy_mb * (1 << 20))
    preferred = [int(p) for p in args.preferred.split(",") if p]
    timing = _GpuTiming()
    if args.gpu_timing:
        timing.install()
    with tempfile.TemporaryDirectory(prefix="kiln-inprocess-gpu-") as tmp:
        repo = _variant(args.repo, Path(tmp), args.instances, preferred, args.fp16_inputs, args.launch)
        config = read_config(repo / MODEL)
        assert config is not None
        if args.streams:
            config.parameters["cuda_streams"].string_value = str(args.streams)
        if args.shared_stream_from:
            config.parameters["cuda_shared_stream_from_batch"].string_value = args.shared_stream_from
        (repo / MODEL / "config.pbtxt").write_text(config_to_text(config))
        server = Server(ServerOptions(repositories=[repo], control_mode="explicit", load_models=(MODEL,)))
        server.start()
        try:
            datatype = DataType.FP16 if args.fp16_inputs else DataType.FP32
            rng = np.random.default_rng(0)
            name, dims = config.input[0].name, tuple(config.input[0].dims)  # one image
            images = [rng.random((1, *dims)).astype(np.float16 if args.fp16_inputs else np.float32)
                      for _ in range(args.concurrency)]
            asyncio.run(_drive(server, name, images, datatype, args.warmup))  # lanes, buffers
            graphs_before = _graphs(server)
            timing.recording = args.gpu_timing
            before = server.model_statistics(MODEL)[0]
            started = time.perf_counter()
            count = asyncio.run(_drive(server, name, images, datatype, args.seconds))
            elapsed = time.perf_counter() - started
            after = server.model_statistics(MODEL)[0]
            timing.recording = False
            graphs_after = _graphs(server)
        finally:
            server.close()
    executions = max(1, after.execution_count - before.execution_count)
    phases = {phase: (getattr(after, phase).ns - getattr(before, phase).ns)
              / max(1, getattr(after, phase).count - getattr(before, phase).count) / 1000
              for phase in ("queue", "compute_input", "compute_infer", "compute_output")}
    print(f"instances {args.instances}, preferred {preferred or '-'}, fp16 inputs {args.fp16_inputs}, "
          f"launch {args.launch}, shared stream from {args.shared_stream_from or 'config'}, "
          f"streams {args.streams or 'config'}, copy threads {staging.COPY_THREADS} from "
          f"{staging.PARALLEL_COPY_BYTES / (1 << 20):g} MB, switch interval {sys.getswitchinterval() * 1e6:,.0f} us, "
          f"c={args.concurrency}: {count / elapsed:,.0f} img/s, average batch "
          f"{(after.inference_count - before.inference_count) / executions:.1f}, "
          + ", ".join(f"{phase} {us:,.0f} us" for phase, us in phases.items())
          + f", lanes {graphs_after[0]}, graphs captured while measured {graphs_after[1] - graphs_before[1]}",
          flush=True)
    if args.gpu_timing:
        print(timing.summary(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
