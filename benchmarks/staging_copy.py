"""How fast one batch of separate request arrays is copied into one pinned host buffer on this machine: numpy on the
calling thread, numpy shared by several threads (what kiln's RowStaging does for large batches), and torch's own
copies (one ``torch.cat`` into the buffer, or one ``copy_`` per request). ResNet-50 sized requests (3x224x224).

    python benchmarks/staging_copy.py --output benchmarks/results/staging_copy-<machine>-<date>.txt
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from _common import Array, describe, header

CASES = ((np.float32, 16), (np.float32, 32), (np.float16, 32), (np.float32, 64))


def _microseconds(run: Callable[[], object], repeats: int) -> float:
    run()
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - started) / repeats * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30, help="timed copies per variant (default 30)")
    parser.add_argument("--output", type=Path, default=None, help="write the text here too")
    args = parser.parse_args(argv)
    pool = ThreadPoolExecutor(8)
    pinned = torch.cuda.is_available()
    info = describe("Staging copies: separate request arrays into one host buffer",
                    settings=f"{os.cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} "
                             f"intra-op threads, pinned buffer: {pinned}, {args.repeats} repeats")
    lines = [header(info)]
    print(lines[0], flush=True)
    for dtype, count in CASES:
        arrays = [np.random.rand(1, 3, 224, 224).astype(dtype) for _ in range(count)]
        buffer = torch.empty((count, 3, 224, 224), dtype=torch.from_numpy(arrays[0]).dtype, pin_memory=pinned)
        view = buffer.numpy()
        megabytes = count * arrays[0].nbytes / 1e6

        def shared(threads: int, arrays: list[Array] = arrays, view: Array = view) -> None:
            def part(first: int) -> None:
                for index in range(first, len(arrays), threads):
                    view[index:index + 1] = arrays[index]
            list(pool.map(part, range(threads)))

        def numpy_loop(arrays: list[Array] = arrays, view: Array = view) -> None:
            for index, array in enumerate(arrays):
                view[index:index + 1] = array

        def torch_cat(arrays: list[Array] = arrays, buffer: torch.Tensor = buffer) -> None:
            torch.cat([torch.from_numpy(a) for a in arrays], out=buffer)

        def torch_copies(arrays: list[Array] = arrays, buffer: torch.Tensor = buffer) -> None:
            for index, array in enumerate(arrays):
                buffer[index:index + 1].copy_(torch.from_numpy(array))

        variants = {"numpy, 1 thread": numpy_loop, "numpy, 2 threads": lambda: shared(2),
                    "numpy, 4 threads": lambda: shared(4), "numpy, 8 threads": lambda: shared(8),
                    "torch.cat": torch_cat, "torch copy_ per request": torch_copies}
        results = {name: _microseconds(run, args.repeats) for name, run in variants.items()}
        line = f"{count} x {arrays[0].nbytes // 1000} KB ({megabytes:.1f} MB): " + "; ".join(
            f"{name} {us:,.0f} us ({megabytes / us * 1e3:.1f} GB/s)" for name, us in results.items())
        lines.append(line)
        print(line, flush=True)
    pool.shutdown()
    if args.output is not None:
        args.output.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
