"""What a launched batch costs the launching thread when its requests' rows lie in a page-locked shared arena (copied
to the device from where they lie: kiln/engines/torch/pinned_host.py) against ordinary host arrays (copied into the
lane's pinned staging buffer first), on the built ResNet-50 of a repository.

Each batch is k separate 3x224x224 requests, launched back to back from one thread with two batches in flight, as
`kiln serve`'s event loop launches them. Rounds alternate the sources. In place, the requests lie either back to
back (one copy per batch, as one worker's consecutive requests) or each with another request between it and the
next (one copy per request, as requests from several workers). Printed per source and batch size: images/s, the
thread's CPU time per batch (``time.thread_time``), and the median wall time of ``launch_parts`` alone: what each
launch holds the event loop (the server reports it per request as compute input). The CPU time includes
collecting each batch, whose wait for the device spins, so compare images/s and the launch time; the CPU column
only shows the launch got no dearer.

    python benchmarks/pinned_rows.py --repo /tmp/gpu16 --output benchmarks/results/pinned_rows-<machine>-<date>.txt
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import describe, header, int_list

import kiln
from kiln.bench.shared_inputs import shared_inputs

Array = np.ndarray[Any, Any]


def _run(engine: Any, parts: list[Array], name: str, output: str, seconds: float) -> tuple[float, float, float]:
    """(images/s, launching-thread CPU us per batch, median us a launch call takes) with two batches in flight."""
    feeds = [{name: part} for part in parts]
    rows = sum(int(part.shape[0]) for part in parts)
    out: deque[Any] = deque()
    for _ in range(3):  # warm: graphs captured, buffers grown, the arena pinned
        engine.launch_parts(feeds, [output]).collect()
    count = 0
    launches: list[float] = []
    wall, cpu = time.perf_counter(), time.thread_time()
    while time.perf_counter() - wall < seconds:
        called = time.perf_counter()
        launched = engine.launch_parts(feeds, [output])
        if launched is None:  # both lanes busy
            out.popleft().collect()
            continue
        launches.append(time.perf_counter() - called)
        out.append(launched)
        count += 1
        if len(out) == 2:
            out.popleft().collect()
    while out:
        out.popleft().collect()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    return count * rows / wall, 1e6 * cpu / count, 1e6 * statistics.median(launches)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, required=True, help="a repository with the built resnet50")
    parser.add_argument("--batches", default="1,2,4,8,16", help="requests (one image each) per batch")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--output", type=Path, default=None, help="write the table here too")
    args = parser.parse_args(argv)
    engine = kiln.load(args.repo / "resnet50", kind="gpu", batching=False)
    spec = engine.spec
    name, output = spec.inputs[0].name, spec.outputs[0].name
    dtype = spec.inputs[0].datatype.numpy_dtype
    rng = np.random.default_rng(0)
    lines = [header(describe("Launched batches: rows in a pinned shared arena against staged host arrays",
                             gpu=f"{torch.cuda.get_device_name()}, torch {torch.__version__}"))]
    lines += ["| requests per batch | round | source | images/s | launching thread CPU us per batch "
              "| launch_parts p50 us |",
              "| ---: | ---: | --- | ---: | ---: | ---: |"]
    print("\n".join(lines), flush=True)
    for batch in int_list(args.batches):
        images = [rng.standard_normal((1, *spec.inputs[0].dims)).astype(dtype) for _ in range(batch)]
        # the images in one listed buffer, as a worker's requests lie in its arena: back to back, or every other one
        with shared_inputs([{name: image} for image in images for _ in range(2)]) as placed:
            views = [request[name] for request in placed]
            sources = {"staged": images, "in place, back to back": views[:batch],
                       "in place, one copy per request": views[::2]}
            for round_ in range(1, args.rounds + 1):
                order = list(sources) if round_ % 2 else list(sources)[::-1]
                for label in order:
                    rate, cpu_us, launch_us = _run(engine, sources[label], name, output, args.seconds)
                    line = f"| {batch} | {round_} | {label} | {rate:,.0f} | {cpu_us:,.0f} | {launch_us:,.0f} |"
                    lines.append(line)
                    print(line, flush=True)
            del sources, placed, views
    engine.close()
    if args.output is not None:
        args.output.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
