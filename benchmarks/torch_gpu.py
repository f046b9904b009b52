"""kiln build --backend torch on a GPU: the demo ResNet-50 in FP16 with CUDA graphs vs eager FP32, direct engine.

Builds the demo ResNet-50 (random weights) with `kiln.build` for the torch backend (FP16, channels_last,
torch.compile 'default', one CUDA graph per batch size), verified against the FP32 ONNX Runtime reference, then
times through `engine.infer()`, side by side in one process:
  - built: the config the build wrote, numpy in and out (host<->device copies of FP32 images included);
  - built, input on the GPU: the same engine given a torch CUDA tensor (what a direct caller whose data already
    lives on the GPU does; the FP32 input is cast on the device, outputs still come back as numpy);
  - eager FP32: the same model.pt2 with no engine parameters (no cast, no compile, no graphs), numpy in and out.
Bar (issue: engine builder): built batch 1 under 1 ms, built batch 256 at least 20,000 images/s.
--base-channels and --image-size shrink the network (same layers) for a quick check. Needs a CUDA device.

    python benchmarks/torch_gpu.py [--batch-sizes 1,16,256] [--seconds 3] --output results/torch_gpu-<date>.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from _common import describe, header, int_list, table, write_outputs

import kiln
from kiln.build import BuildOptions, build
from kiln.demo.resnet import build_resnet50


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16,256")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed window per engine and batch size")
    parser.add_argument("--compile-mode", default="default")
    parser.add_argument("--base-channels", type=int, default=64, help="ResNet-50's first width (default 64)")
    parser.add_argument("--image-size", type=int, default=224, help="input images are SIZE x SIZE (default 224)")
    parser.add_argument("--min-top1", type=float, default=None,
                        help="the build's top-1 agreement tolerance (default: kiln build's); a shrunken random "
                             "network's nearly equal classes flip under FP16, so its smoke test passes 0")
    parser.add_argument("--output", type=Path, default=None, help="JSON results (a .txt beside it gets the text)")
    args = parser.parse_args(argv)
    import torch

    sizes = int_list(args.batch_sizes)
    image = (3, args.image_size, args.image_size)
    info = describe("kiln build --backend torch: ResNet-50 FP16 + CUDA graphs vs eager FP32 (direct engine)",
                    gpu=f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}",
                    network=f"base channels {args.base_channels}, images {args.image_size}x{args.image_size}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-torch-") as tmp:
        source = Path(tmp) / "resnet50.onnx"
        onnx.save(build_resnet50(0, base_channels=args.base_channels, image_size=args.image_size), str(source))
        repo = Path(tmp) / "repo"
        started = time.perf_counter()
        report = build(source, repo / "resnet50", BuildOptions(
            backend="torch", device="cuda", precision="fp16", channels_last=True, compile_mode=args.compile_mode,
            torch_format="export", max_batch_size=max(sizes), samples=16, min_top1=args.min_top1))
        build_s = time.perf_counter() - started
        eager = repo / "resnet50_eager"
        shutil.copytree(repo / "resnet50", eager)
        config = (eager / "config.pbtxt").read_text()
        config = config.replace('name: "resnet50"', 'name: "resnet50_eager"')
        config = config[:config.index("parameters")] if "parameters" in config else config
        (eager / "config.pbtxt").write_text(config)
        rng = np.random.default_rng(0)
        with kiln.load(repo / "resnet50", kind="gpu") as built, kiln.load(eager, kind="gpu") as reference:
            for batch in sizes:
                feed = {"input": rng.standard_normal((batch, *image)).astype(np.float32)}
                on_gpu = {"input": torch.from_numpy(feed["input"]).cuda()}
                runs: tuple[tuple[str, kiln.Engine, Mapping[str, Any]], ...] = (
                    ("eager fp32", reference, feed), ("built fp16 + cuda graphs", built, feed),
                    ("built, input on the GPU", built, on_gpu))
                for name, engine, data in runs:
                    ms = _median_ms(engine, data, args.seconds)
                    rows.append({"engine": name, "batch": batch, "median_ms": ms, "images_per_s": batch * 1000 / ms})
    passed, verdict = _bar(rows)
    text = (header(info) + f"build + verify: {build_s:.1f} s; steps {report.timings_s}\n{report.summary()}\n\n"
            + table(["engine", "batch", "median latency ms", "images/s"],
                    [[r["engine"], r["batch"], r["median_ms"], r["images_per_s"]] for r in rows])
            + verdict)
    print(text)
    write_outputs(args.output, {"machine": info, "rows": rows, "build_s": build_s, "passed": passed,
                                "report": json.loads(json.dumps(report.as_dict(), default=str))}, text)
    return 1 if passed is False else 0


def _bar(rows: list[dict[str, Any]]) -> tuple[bool | None, str]:
    """The bar reads the best direct mode: input on the GPU at large batch, numpy at batch 1 (both direct calls).
    None when batch 1 or 256 was not measured."""
    best: dict[int, dict[str, Any]] = {}
    for r in rows:
        known = best.get(r["batch"])
        if r["engine"].startswith("built") and (known is None or r["median_ms"] < known["median_ms"]):
            best[r["batch"]] = r
    b1, b256 = best.get(1), best.get(256)
    if b1 is None or b256 is None:
        return None, "\nbar: not measured (needs batch sizes 1 and 256)\n"
    passed = b1["median_ms"] < 1.0 and b256["images_per_s"] >= 20_000
    return passed, (f"\nbar: batch 1 {b1['median_ms']:.3f} ms < 1 ms and batch 256 {b256['images_per_s']:,.0f} "
                    f"images/s >= 20,000: {'PASS' if passed else 'FAIL'}\n")


def _median_ms(engine: kiln.Engine, feed: Mapping[str, Any], seconds: float) -> float:
    for _ in range(5):  # first calls compile and capture graphs for this batch size
        engine.infer(feed)
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 10:
        start = time.perf_counter()
        engine.infer(feed)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


if __name__ == "__main__":
    sys.exit(main())
