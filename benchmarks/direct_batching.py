"""The direct engine with and without batching: threads calling one ``kiln.load``'d engine, one row per call.

With ``batching=True`` (the default for a GPU engine whose config has ``dynamic_batching``) concurrent calls are
coalesced into batches by the batching core the server uses; with ``batching=False`` each call runs on its own.
For every thread count both are measured in turn on the same model: calls/s, p50/p99 latency of a call, and the
average batch the engine executed. Answers are checked against a single unbatched call.

    python benchmarks/direct_batching.py --model mlp --threads 1,4,16 --seconds 5 \\
        --output benchmarks/results/direct-batching-<date>.json
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _common import describe, header, int_list, table, write_outputs

import kiln
from kiln.demo import build_demo_repository
from kiln.direct import BatchingEngine


def measure(model_dir: Path, batching: bool, threads: int, seconds: float, warmup: float) -> dict[str, Any]:
    """``threads`` callers on one engine for ``seconds`` (after ``warmup``): calls/s, latency, average batch."""
    with kiln.load(model_dir, batching=batching) as engine:
        spec = engine.inputs[0]
        rng = np.random.default_rng(7)
        dtype = spec.datatype.numpy_dtype
        rows = [rng.standard_normal((1, *spec.dims)).astype(dtype) for _ in range(threads)]
        # batched fp16 kernels may pick other algorithms than batch 1: compare at the type's precision
        rtol, atol = (2e-2, 2e-2) if dtype.itemsize < 4 else (1e-5, 1e-6)
        expected = [engine.infer({spec.name: row}) for row in rows]
        latencies: list[list[int]] = [[] for _ in range(threads)]
        start_at = time.monotonic() + warmup
        stop_at = start_at + seconds
        before: list[int] = []

        def caller(index: int) -> None:
            inputs = {spec.name: rows[index]}
            while (now := time.monotonic()) < stop_at:
                began = time.perf_counter_ns()
                outputs = engine.infer(inputs)
                if now >= start_at:
                    latencies[index].append(time.perf_counter_ns() - began)
            for name, value in expected[index].items():  # the last answer, checked once
                np.testing.assert_allclose(outputs[name], value, rtol=rtol, atol=atol)

        workers = [threading.Thread(target=caller, args=(i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        time.sleep(max(0.0, start_at - time.monotonic()))
        if isinstance(engine, BatchingEngine):
            before = [engine.batch_log.executions, engine.batch_log.inferences]
        for worker in workers:
            worker.join()
        calls = np.array([ns for per_thread in latencies for ns in per_thread], dtype=np.int64)
        average_batch = 1.0
        if isinstance(engine, BatchingEngine) and before:
            executions = engine.batch_log.executions - before[0]
            average_batch = (engine.batch_log.inferences - before[1]) / max(1, executions)
    return {"batching": batching, "threads": threads, "calls_per_s": len(calls) / seconds,
            "p50_ms": float(np.percentile(calls, 50)) / 1e6 if len(calls) else None,
            "p99_ms": float(np.percentile(calls, 99)) / 1e6 if len(calls) else None,
            "average_batch": average_batch}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp", help="a model of the demo repository, or a model folder")
    parser.add_argument("--threads", default="1,4,16")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--output", type=Path, default=None, help="JSON results (a .txt beside it gets the text)")
    args = parser.parse_args(argv)

    info = describe(f"kiln.load() from many threads: batching on vs off ({args.model})")
    print(header(info), flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-direct-batching-") as tmp:
        model_dir = Path(args.model)
        if not model_dir.is_dir():
            build_demo_repository(Path(tmp), include_resnet50=args.model == "resnet50")
            model_dir = Path(tmp) / args.model
        for threads in int_list(args.threads):
            for batching in (True, False):
                row = measure(model_dir, batching, threads, args.seconds, args.warmup)
                rows.append(row)
                print(f"threads={threads} batching={'on' if batching else 'off'}: {row['calls_per_s']:.0f} calls/s",
                      flush=True)
    text = table(["threads", "batching", "calls/s", "p50 ms", "p99 ms", "average batch"],
                 [[r["threads"], "on" if r["batching"] else "off", r["calls_per_s"], r["p50_ms"], r["p99_ms"],
                   r["average_batch"]] for r in rows])
    print(text)
    write_outputs(args.output, {"info": info, "rows": rows}, header(info) + "\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
