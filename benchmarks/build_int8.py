"""INT8 build on the CPU: `kiln build --precision int8` of the demo ResNet-50 vs its FP32 reference.

Bar (issue: engine builder): the built INT8 model runs at least 1.7x faster than the FP32 reference at batch 1,
with top-1 agreement of at least 95% on the calibration inputs. Both engines run in this process, ONNX Runtime CPU
execution provider, timed alternately (one reference call, one INT8 call, ...) so both see the same machine state.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command_line, header_lines, machine_info, write_json

import kiln
from kiln.build import BuildOptions, build
from kiln.demo.resnet import build_resnet50


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calibration-samples", type=int, default=32)
    parser.add_argument("--method", default="minmax", choices=["minmax", "entropy", "percentile"])
    parser.add_argument("--runs", type=int, default=40, help="timed calls per engine and batch size")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--bar", type=float, default=1.7)
    parser.add_argument("--min-top1", type=float, default=0.95)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    info = machine_info()
    info["command"] = command_line()
    lines = header_lines("kiln build: INT8 ResNet-50 vs FP32 reference (ONNX Runtime CPU)", info)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-int8-") as tmp:
        source = Path(tmp) / "resnet50.onnx"
        onnx.save(build_resnet50(0), str(source))
        rng = np.random.default_rng(7)
        calibration = Path(tmp) / "calibration.npz"
        np.savez(calibration, input=rng.standard_normal((args.calibration_samples, 3, 224, 224)).astype(np.float32))
        started = time.perf_counter()
        report = build(source, Path(tmp) / "repo" / "resnet50",
                       BuildOptions(precision="int8", calibration_data=calibration, min_top1=args.min_top1,
                                    calibration_method=args.method, max_batch_size=16))
        build_s = time.perf_counter() - started
        assert report.accuracy is not None
        top1 = report.accuracy.outputs[0].top1_agreement or 0.0
        rows = []
        with kiln.load(source) as reference, kiln.load(Path(tmp) / "repo" / "resnet50") as built:
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                feed = {"input": rng.standard_normal((batch, 3, 224, 224)).astype(np.float32)}
                ref_ms, int8_ms = _alternate(reference, built, feed, args.runs)
                rows.append({"batch": batch, "fp32_ms": ref_ms, "int8_ms": int8_ms, "speedup": ref_ms / int8_ms})
    lines.append(f"build: {build_s:.1f} s ({args.method} calibration, {args.calibration_samples} samples); "
                 f"steps: {report.timings_s}")
    lines.append(f"runtime ops of the INT8 model: {report.details['runtime_ops']}")
    lines.append(f"top-1 agreement on the calibration inputs: {top1:.1%} (bar {args.min_top1:.0%})")
    lines.append("| batch | FP32 ms (median) | INT8 ms (median) | speedup |")
    lines.append("|---|---|---|---|")
    lines += [f"| {r['batch']} | {r['fp32_ms']:.2f} | {r['int8_ms']:.2f} | {r['speedup']:.2f}x |" for r in rows]
    batch1 = next(r for r in rows if r["batch"] == 1)
    passed = batch1["speedup"] >= args.bar and top1 >= args.min_top1
    lines.append(f"bar: batch-1 speedup {batch1['speedup']:.2f}x >= {args.bar}x and top-1 {top1:.1%} >= "
                 f"{args.min_top1:.0%}: {'PASS' if passed else 'FAIL'}")
    print("\n".join(lines))
    if args.output:
        write_json(args.output, {"command": command_line(), "machine": info, "rows": rows, "top1": top1,
                                 "build_s": build_s, "report": report.as_dict(), "passed": passed})
    return 0 if passed else 1


def _alternate(reference: kiln.Engine, built: kiln.Engine, feed: dict[str, np.ndarray],
               runs: int) -> tuple[float, float]:
    for _ in range(3):
        reference.infer(feed)
        built.infer(feed)
    ref, int8 = [], []
    for _ in range(runs):
        for engine, sink in ((reference, ref), (built, int8)):
            start = time.perf_counter()
            engine.infer(feed)
            sink.append((time.perf_counter() - start) * 1000)
    return statistics.median(ref), statistics.median(int8)


if __name__ == "__main__":
    sys.exit(main())
