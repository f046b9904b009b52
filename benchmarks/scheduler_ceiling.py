"""What the in-process serving path can feed to an accelerator, measured without one.

A GPU-like engine stands in for the model: it stages each batch's rows into one host buffer exactly as the PyTorch
backend does (kiln's RowStaging, unpinned here), then holds no GIL for ``base + per_row x rows`` (a sleep), the
way a thread waits for a CUDA stream. Clients are coroutines calling ``kiln.Server.infer`` on one event loop, as
the frontends do. The printout compares the served rate with what the fake device alone allows at the batch sizes
that were actually formed, so what is lost between batches (queueing, staging, answering, resubmitting) shows as
the gap. The defaults resemble ResNet-50 FP16 on an H200: FP32 images of 3x224x224, about 1.0 ms per batch plus
30 us per image. Each setting runs on both serving paths side by side: batches run by the instances' worker
threads, and batches launched from the event loop (docs/scheduling.md, "Launched execution").

    python benchmarks/scheduler_ceiling.py --output benchmarks/results/scheduler_ceiling-<date>.json
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _common import Array, describe, header, int_list, table, write_outputs

from kiln.config.spec import ModelSpec
from kiln.engines import Engine, EngineOptions, host_memory, register_backend
from kiln.server import InferRequest, InputTensor, Server, ServerOptions
from kiln.tensor import DataType

BACKEND = "kiln_bench_device_stand_in"
CONFIG = """
backend: "{backend}" max_batch_size: {max_batch}
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ {dims} ] }} ]
output [ {{ name: "y" data_type: TYPE_FP32 dims: [ 10 ] }} ]
instance_group [ {{ kind: KIND_CPU count: {instances} }} ]
dynamic_batching {{ {batching} }}
parameters {{ key: "launch_execution" value {{ string_value: "{launch}" }} }}
"""
PATHS = {"workers": "off", "launched": "auto"}  # --paths name: the config's launch_execution


class DeviceStandIn(Engine):
    """Stages rows like the PyTorch backend, then waits without the GIL as a CUDA stream would. Like a CUDA graph
    engine it can also launch a batch (on one of ``SLOTS`` staging buffers, the lanes) and be waited for later;
    each instance's device runs one batch at a time in both paths."""

    thread_safe = False
    launches = True
    in_place = False  # read rows lying in listed shared memory where they lie, as the PyTorch backend on a GPU does
    base_s = 0.001
    per_row_s = 0.00003
    SLOTS = 8

    def __init__(self, spec: ModelSpec, model_file: Path, options: EngineOptions) -> None:
        super().__init__(spec)
        from kiln.engines.torch.staging import RowStaging
        from kiln.engines.torch.tensors import torch_dtype

        first = spec.inputs[0]  # the one input; its rows are staged as the PyTorch backend stages them
        self._input = first.name
        self._width = spec.outputs[0].dims[0]  # each row's answer: its first values, as FP32
        dtype = torch_dtype(spec, first, "input")
        self._slots = [RowStaging(dtype, first.dims, batching=True, max_rows=spec.max_batch_size, pinned=False)
                       for _ in range(self.SLOTS)]
        self._lock = threading.Lock()
        self._device_free_at = 0.0

    def execute(self, inputs: Mapping[str, Any], outputs: Sequence[str]) -> dict[str, Any]:
        return self.execute_parts([inputs], outputs)

    def execute_parts(self, parts: Sequence[Mapping[str, Any]], outputs: Sequence[str]) -> dict[str, Any]:
        launched = self.launch_parts(parts, outputs)
        assert launched is not None, "the worker path holds one slot at a time"
        launched.wait()
        return launched.collect()

    def launch_parts(self, parts: Sequence[Mapping[str, Any]], outputs: Sequence[str]) -> _StandInBatch | None:
        with self._lock:
            if not self._slots:
                return None
            staging = self._slots.pop()
        arrays = [part[self._input] for part in parts]
        if self.in_place and all(host_memory.containing(a.ctypes.data, a.nbytes) for a in arrays):
            staged: Any = arrays  # a worker's pinned arena: the device copies from there, no host copy
            rows = sum(int(a.shape[0]) for a in arrays)
        else:
            staged = staging.fill(arrays)
            rows = int(staged.shape[0])
        with self._lock:  # the device takes batches in launch order, one at a time
            self._device_free_at = max(time.monotonic(), self._device_free_at) + self.base_s + self.per_row_s * rows
            done_at = self._device_free_at
        return _StandInBatch(self, staging, staged, done_at, outputs[0])

    def give_back(self, staging: Any) -> None:
        with self._lock:
            self._slots.append(staging)


class _StandInBatch:
    def __init__(self, engine: DeviceStandIn, staging: Any, staged: Any, done_at: float, output: str) -> None:
        self._engine, self._staging, self._staged, self._done_at, self._output = (engine, staging, staged, done_at,
                                                                                  output)

    def wait(self) -> None:
        time.sleep(max(0.0, self._done_at - time.monotonic()))

    def collect(self) -> dict[str, Any]:
        if time.monotonic() < self._done_at:  # a sleep gives up the GIL even when there is nothing to wait for
            self.wait()
        width = self._engine._width
        if isinstance(self._staged, list):  # rows read in place
            first = [a.reshape(a.shape[0], -1)[:, :width] for a in self._staged]
            result = {self._output: np.concatenate(first).astype(np.float32)}
        else:
            rows = int(self._staged.shape[0])
            result = {self._output: self._staged.reshape(rows, -1)[:, :width].float().numpy().copy()}
        self._engine.give_back(self._staging)
        return result


async def _drive(server: Server, image: Array, concurrency: int, seconds: float) -> int:
    done = 0
    stop = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await server.infer(InferRequest("m", [InputTensor("x", DataType.FP32, image.shape, image)]))
            done += 1

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done


def _measure(repo: Path, image: Array, concurrency: int, seconds: float) -> dict[str, Any]:
    server = Server(ServerOptions(repositories=[repo]))
    server.start()
    try:
        asyncio.run(_drive(server, image, concurrency, min(1.0, seconds)))  # warm-up: buffers, statistics
        before = server.model_statistics("m")[0]
        started = time.perf_counter()
        count = asyncio.run(_drive(server, image, concurrency, seconds))
        elapsed = time.perf_counter() - started
        after = server.model_statistics("m")[0]
    finally:
        server.close()
    executions = after.execution_count - before.execution_count
    rows = after.inference_count - before.inference_count
    batch = rows / executions if executions else 0.0
    served = count / elapsed
    device_bound = batch / (DeviceStandIn.base_s + DeviceStandIn.per_row_s * batch) if batch else 0.0
    per_request_us = {phase: (getattr(after, phase).ns - getattr(before, phase).ns)
                      / max(1, getattr(after, phase).count - getattr(before, phase).count) / 1000
                      for phase in ("queue", "compute_infer")}
    return {"concurrency": concurrency, "requests_per_s": served, "average_batch": batch,
            "device_bound_per_s": device_bound, "of_device_bound": served / device_bound if device_bound else 0.0,
            "queue_us": per_request_us["queue"], "compute_infer_us": per_request_us["compute_infer"],
            "client_latency_us": concurrency / served * 1e6 if served else 0.0}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--instances", default="1,2")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--preferred", default="", help="preferred_batch_size list, e.g. 8")
    parser.add_argument("--paths", default="workers,launched",
                        help="workers (instances' worker threads run batches) and/or launched (the event loop "
                             "launches them: docs/scheduling.md)")
    parser.add_argument("--dims", default="3,224,224", help="one request's image, FP32")
    parser.add_argument("--base-ms", type=float, default=1.0, help="fake device time per batch")
    parser.add_argument("--per-row-us", type=float, default=30.0, help="fake device time per image")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--output", type=Path, default=None, help="JSON results; a .txt beside it gets the table")
    args = parser.parse_args(argv)
    DeviceStandIn.base_s, DeviceStandIn.per_row_s = args.base_ms / 1000, args.per_row_us / 1e6
    register_backend(BACKEND, DeviceStandIn)
    dims = [int(d) for d in args.dims.split(",")]
    image = np.random.default_rng(0).standard_normal([1, *dims]).astype(np.float32)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-ceiling-") as tmp:
        for instances in int_list(args.instances):
            for concurrency in int_list(args.concurrency):
                for path in args.paths.split(","):  # side by side, so the machine's drift hits both alike
                    repo = Path(tmp) / f"i{instances}-{path}"
                    if not repo.exists():
                        (repo / "m" / "1").mkdir(parents=True)
                        (repo / "m" / "config.pbtxt").write_text(CONFIG.format(
                            backend=BACKEND, max_batch=args.max_batch_size, dims=", ".join(map(str, dims)),
                            instances=instances, launch=PATHS[path],
                            batching=f"preferred_batch_size: [ {args.preferred} ]" if args.preferred else ""))
                    row = {"instances": instances, "path": path, **_measure(repo, image, concurrency, args.seconds)}
                    rows.append(row)
                    print(row, file=sys.stderr, flush=True)
    info = describe("kiln scheduler ceiling: in-process serving against a device stand-in",
                    stand_in=f"{args.base_ms:g} ms per batch + {args.per_row_us:g} us per image, FP32 images "
                             f"{'x'.join(map(str, dims))}, max_batch_size {args.max_batch_size}, {args.seconds:g} s "
                             f"per row")
    text = header(info) + "\n" + table(
        ["instances", "path", "conc", "req/s", "avg batch", "device-bound req/s", "served/device-bound", "queue us",
         "compute_infer us", "client latency us"],
        [[r["instances"], r["path"], r["concurrency"], r["requests_per_s"], f"{r['average_batch']:.1f}",
          r["device_bound_per_s"], f"{r['of_device_bound']:.2f}", r["queue_us"], r["compute_infer_us"],
          r["client_latency_us"]] for r in rows], numeric_from=2)
    print(text)
    write_outputs(args.output, {**info, "rows": rows, "settings": vars(args)}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
