"""What the GPU itself gives for batches of B images fed from K CUDA streams at once, with no server around it.

The measurement is the package's (kiln.build.gpu_limit, which `kiln build` reports as the build's GPU limit): each
stream owns a CUDA graph of the built module (FP16, channels-last) for batch B, a device input, and pinned host
buffers for its input (FP16) and output; one thread queues batches round-robin over the streams, never waiting on
the host, and times the whole run, so the figure is the GPU's (and copy engines') limit for that layout. Modes:

* ``copies``: each batch copies its input in, replays, copies its output out, all on its stream (kiln's lanes);
* ``one compute stream``: the copies stay on each stream, the replays all go to one shared stream, ordered after
  their own copy in by events: the GPU runs graphs one after another while copies overlap them;
* ``graph only``: replays on the K streams, no copies: how much interleaving kernels of K graphs costs or gains.

    python3 benchmarks/gpu_streams.py --repo /tmp/gpu [--batches 16,32] [--streams 1,2,4] [--seconds 1.5]

The repository holds the built resnet50 (kiln build ... --backend torch --device cuda --precision fp16
--channels-last; with --compile-mode auto the build may have kept the compiled module, which is what is measured
then). Prints one line per layout: images/s and ms per batch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from _common import describe, header, int_list

import kiln
from kiln.build.gpu_limit import MODES, make_lane, measure


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

    def run(inputs: Sequence[torch.Tensor]) -> object:
        return module(*inputs)

    def images(batch: int) -> list[torch.Tensor]:
        image = torch.randn(batch, *dims, device="cuda", dtype=torch.float16)
        return [image.contiguous(memory_format=torch.channels_last)]

    compute = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    print(header(describe("The GPU's own limit: batches queued from K CUDA streams, no server",
                          gpu=f"{torch.cuda.get_device_name()}, torch {torch.__version__}")), flush=True)
    for batch in int_list(args.batches):
        for streams in int_list(args.streams):
            lanes = [make_lane(run, images(batch)) for _ in range(streams)]
            for mode in MODES:
                count, elapsed = measure(lanes, mode, compute, args.seconds)
                print(f"batch {batch:3d}, {streams} streams, {mode:18s}: {count * batch / elapsed:8,.0f} images/s, "
                      f"{1000 * elapsed / count:.3f} ms per batch", flush=True)
            del lanes
            torch.cuda.synchronize()
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
