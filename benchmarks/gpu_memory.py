"""Where a loaded GPU engine's memory goes: the CUDA context, the load (weights, CUDA graphs captured at load, the
caching allocator's blocks left by the warm-up runs), what `torch.cuda.empty_cache()` hands back, and the growth
after batches of other sizes.

    python benchmarks/gpu_memory.py /tmp/gpu/resnet50 --graph-sizes "1-64;1,64;1,2,4,8,16,32,64" --batches 1,8,32,64

Each --graph-sizes entry (entries separated by semicolons, each a `cuda_graph_batch_sizes` value) loads the model in
a fresh process with that `cuda_graph_batch_sizes` value, so the figures of one never include another's. `kiln build
--device cuda` writes 1-<max batch size> (at most 1-64). Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import describe, header

from kiln.config.parse import config_to_text, read_config

MIB = 1 << 20


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="a built model folder (<repo>/<model>) for the torch backend")
    parser.add_argument("--graph-sizes", default="1-64;1,64;1,2,4,8,16,32,64",
                        help="cuda_graph_batch_sizes values to compare, separated by semicolons")
    parser.add_argument("--batches", default="1,8,32,64", help="batch sizes run after the load")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(_measure(args.model, [int(b) for b in args.batches.split(",")])))
        return 0
    print(header(describe("Where a loaded GPU engine's memory goes", model=str(args.model))), flush=True)
    print(f"{'cuda_graph_batch_sizes':>22}  {'stage':<28} {'allocated MiB':>13} {'reserved MiB':>12} "
          f"{'device MiB':>10}")
    for sizes in args.graph_sizes.split(";"):
        with tempfile.TemporaryDirectory(prefix="kiln-gpu-memory-") as tmp:
            model = Path(tmp) / args.model.name
            shutil.copytree(args.model, model)
            config = read_config(model)
            assert config is not None
            config.parameters["cuda_graph_batch_sizes"].string_value = sizes
            (model / "config.pbtxt").write_text(config_to_text(config))
            result = subprocess.run([sys.executable, __file__, str(model), "--batches", args.batches, "--child", "1"],
                                    capture_output=True, text=True, check=True)
            for stage in json.loads(result.stdout.strip().splitlines()[-1]):
                print(f"{sizes:>22}  {stage['stage']:<28} {stage['allocated']:>13,.0f} {stage['reserved']:>12,.0f} "
                      f"{stage['device']:>10,.0f}")
    return 0


def _measure(model: Path, batches: list[int]) -> list[dict[str, Any]]:
    import numpy as np
    import torch

    import kiln

    stages: list[dict[str, Any]] = []

    def note(stage: str) -> None:
        free, total = torch.cuda.mem_get_info()
        stages.append({"stage": stage, "allocated": torch.cuda.memory_allocated() / MIB,
                       "reserved": torch.cuda.memory_reserved() / MIB, "device": (total - free) / MIB})

    torch.zeros(1, device="cuda")
    note("CUDA context")
    engine = kiln.load(model, kind="gpu")
    note(f"loaded ({engine.cuda_graph_count} graphs)")  # type: ignore[attr-defined]
    torch.cuda.empty_cache()
    note("after empty_cache")
    spec = engine.spec
    rng = np.random.default_rng(0)
    for batch in batches:
        feed = {t.name: rng.random((batch, *t.dims)).astype(t.datatype.numpy_dtype) for t in spec.inputs}
        engine.infer(feed)
    note(f"after batches {','.join(map(str, batches))}")
    engine.close()
    torch.cuda.empty_cache()
    note("closed")
    return stages


if __name__ == "__main__":
    sys.exit(main())
