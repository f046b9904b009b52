"""INT8 build on the CPU: `kiln build --precision int8` of the demo ResNet-50 vs its FP32 reference.

Bar (issue: engine builder): the built INT8 model runs at least 1.7x faster than the FP32 reference at batch 1,
with top-1 agreement of at least 95% on the calibration inputs. Both engines run in this process, ONNX Runtime CPU
execution provider, timed alternately (one reference call, one INT8 call, ...) so both see the same machine state.
--base-channels and --image-size shrink the network (same layers, fewer channels, smaller images) for a quick
check of the build itself.

    python benchmarks/build_int8.py --output benchmarks/results/build_int8-<machine>-<date>.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from _common import Array, describe, header, int_list, table, write_outputs

import kiln
from kiln.build import BuildOptions, build
from kiln.demo.resnet import build_resnet50


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibration-samples", type=int, default=32)
    parser.add_argument("--method", default="minmax", choices=["minmax", "entropy", "percentile"])
    parser.add_argument("--runs", type=int, default=40, help="timed calls per engine and batch size")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--bar", type=float, default=1.7)
    parser.add_argument("--min-top1", type=float, default=0.95)
    parser.add_argument("--base-channels", type=int, default=64, help="ResNet-50's first width (default 64)")
    parser.add_argument("--image-size", type=int, default=224, help="input images are SIZE x SIZE (default 224)")
    parser.add_argument("--output", type=Path, default=None, help="JSON results (a .txt beside it gets the text)")
    args = parser.parse_args(argv)
    info = describe("kiln build: INT8 ResNet-50 vs FP32 reference (ONNX Runtime CPU)",
                    network=f"base channels {args.base_channels}, images {args.image_size}x{args.image_size}")
    image = (3, args.image_size, args.image_size)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-int8-") as tmp:
        source = Path(tmp) / "resnet50.onnx"
        onnx.save(build_resnet50(0, base_channels=args.base_channels, image_size=args.image_size), str(source))
        rng = np.random.default_rng(7)
        calibration = Path(tmp) / "calibration.npz"
        np.savez(calibration, input=rng.standard_normal((args.calibration_samples, *image)).astype(np.float32))
        started = time.perf_counter()
        report = build(source, Path(tmp) / "repo" / "resnet50",
                       BuildOptions(precision="int8", calibration_data=calibration, min_top1=args.min_top1,
                                    calibration_method=args.method, max_batch_size=16))
        build_s = time.perf_counter() - started
        assert report.accuracy is not None
        top1 = report.accuracy.outputs[0].top1_agreement or 0.0
        rows = []
        with kiln.load(source) as reference, kiln.load(Path(tmp) / "repo" / "resnet50") as built:
            for batch in int_list(args.batch_sizes):
                feed = {"input": rng.standard_normal((batch, *image)).astype(np.float32)}
                ref_ms, int8_ms = _alternate(reference, built, feed, args.runs)
                rows.append({"batch": batch, "fp32_ms": ref_ms, "int8_ms": int8_ms, "speedup": ref_ms / int8_ms})
    batch1 = next(r for r in rows if r["batch"] == 1)
    passed = batch1["speedup"] >= args.bar and top1 >= args.min_top1
    text = (header(info)
            + f"build: {build_s:.1f} s ({args.method} calibration, {args.calibration_samples} samples); steps: "
              f"{report.timings_s}\nruntime ops of the INT8 model: {report.details['runtime_ops']}\n"
              f"top-1 agreement on the calibration inputs: {top1:.1%} (bar {args.min_top1:.0%})\n\n"
            + table(["batch", "FP32 ms (median)", "INT8 ms (median)", "speedup"],
                    [[r["batch"], r["fp32_ms"], r["int8_ms"], f"{r['speedup']:.2f}x"] for r in rows])
            + f"\nbar: batch-1 speedup {batch1['speedup']:.2f}x >= {args.bar}x and top-1 {top1:.1%} >= "
              f"{args.min_top1:.0%}: {'PASS' if passed else 'FAIL'}\n")
    print(text)
    write_outputs(args.output, {"machine": info, "rows": rows, "top1": top1, "build_s": build_s,
                                "report": report.as_dict(), "passed": passed}, text)
    return 0 if passed else 1


def _alternate(reference: kiln.Engine, built: kiln.Engine, feed: dict[str, Array],
               runs: int) -> tuple[float, float]:
    for _ in range(3):
        reference.infer(feed)
        built.infer(feed)
    ref: list[float] = []
    int8: list[float] = []
    for _ in range(runs):
        for engine, sink in ((reference, ref), (built, int8)):
            start = time.perf_counter()
            engine.infer(feed)
            sink.append((time.perf_counter() - start) * 1000)
    return statistics.median(ref), statistics.median(int8)


if __name__ == "__main__":
    sys.exit(main())
