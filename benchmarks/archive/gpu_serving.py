"""Serving throughput on a GPU: the demo ResNet-50 built for the torch backend, batch-1 requests, measured direct
(``kiln bench --target direct``: N threads calling one engine) and served in-process (``--target inprocess``: a
``kiln.Server`` in this process, its schedulers included, no network), with and without dynamic batching and with
1, 2 and 4 instances on the one GPU, with preferred batch sizes, and as built (two instances, preferred sizes 16
and 32), also with FP16 images (301 KB per request instead of 602 KB).

The model is built as `kiln build --backend torch --device cuda --precision fp16 --channels-last --max-batch-size
64` builds it (random weights, FP32 images in, FP32 logits out); each variant below edits only the config. Every
level is measured by kiln's own bench runner (windows of --window-ms until stable, at most --max-trials).

Bars: served with dynamic batching >= 8,000 images/s at concurrency 16 and >= 12,000 at concurrency 64; direct
at concurrency 16 near 5,400 images/s (a CUDA graph and a CUDA stream per calling thread, plain PyTorch).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command_line, format_table, machine_info, write_json

from kiln.bench import BenchOptions, BenchResult, LevelResult, run
from kiln.build import BuildOptions, build
from kiln.config.parse import config_to_text, read_config
from kiln.demo.resnet import build_resnet50
from kiln.v2._generated import model_config_pb2 as pb

MODEL = "resnet50"
BARS = {16: 8_000.0, 64: 12_000.0}  # served, dynamic batching, images/s
DIRECT_REFERENCE = {8: 4_760.0, 16: 5_400.0}  # plain PyTorch, a graph and a stream per thread (anchors 3b)


@dataclass(frozen=True)
class Variant:
    name: str
    target: str  # direct | inprocess
    batching: bool = True
    instances: int = 1
    delay_us: int = 0
    switch_interval_s: float | None = None  # sys.setswitchinterval while this variant runs
    preferred: tuple[int, ...] = ()  # dynamic_batching.preferred_batch_size
    as_built: bool = False  # keep the build's instances and preferred sizes (2 GPU instances, an eighth and a half)
    fp16_inputs: bool = False  # the config takes FP16 images (301 KB) instead of FP32 (602 KB)
    parameters: dict[str, str] = field(default_factory=dict)


def variants(instances: list[int]) -> list[Variant]:
    chosen = [Variant("direct", "direct"),
              Variant("served, no batching, 1 instance", "inprocess", batching=False)]
    chosen += [Variant(f"served, batching, {n} instance{'s' * (n > 1)}", "inprocess", instances=n) for n in instances]
    best = 2 if 2 in instances else instances[-1]
    chosen += [Variant(f"served, batching, {best} instances, delay 200 us", "inprocess", instances=best, delay_us=200),
               Variant(f"served, batching, {best} instances, GIL switch 0.5 ms", "inprocess", instances=best,
                       switch_interval_s=0.0005),
               Variant(f"served, batching, {best} instances, preferred 8,32", "inprocess", instances=best,
                       preferred=(8, 32)),
               Variant("served, batching, as built", "inprocess", instances=0, as_built=True),
               Variant("served, batching, as built, GIL switch 0.5 ms", "inprocess", instances=0, as_built=True,
                       switch_interval_s=0.0005),
               Variant("served, batching, as built, GIL switch 0.2 ms", "inprocess", instances=0, as_built=True,
                       switch_interval_s=0.0002),
               Variant("served, batching, as built, FP16 inputs", "inprocess", instances=0, as_built=True,
                       fp16_inputs=True),
               Variant("served, batching, as built, worker threads", "inprocess", instances=0, as_built=True,
                       parameters={"launch_execution": "off"}),
               Variant(f"served, batching, {best} instances, preferred 16, FP16 inputs", "inprocess",
                       instances=best, preferred=(16,), fp16_inputs=True)]
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--instances", default="1,2,4")
    parser.add_argument("--window-ms", type=int, default=2000)
    parser.add_argument("--max-trials", type=int, default=4)
    parser.add_argument("--only", default="",
                        help="variant name prefixes to run, separated by semicolons (default: all)")
    parser.add_argument("--output", type=Path, default=None, help="JSON results; a .txt beside it gets the table")
    args = parser.parse_args()
    import torch

    levels = tuple(int(c) for c in args.concurrency.split(","))
    info = {**machine_info({"torch": torch.__version__}), "command": command_line()}
    lines = ["# kiln serving throughput on a GPU: ResNet-50 FP16 (torch backend), batch-1 requests",
             f"command: {info['command']}", f"date:    {info['date']}",
             f"machine: nproc={info['nproc']}, CPU '{info['cpu_model']}', memory {info['mem_total']}, {info['os']}",
             f"gpu:     {torch.cuda.get_device_name(0)}, torch {torch.__version__}, python {info['python']}",
             f"windows: {args.window_ms} ms, at most {args.max_trials} per level"]
    print("\n".join(lines), flush=True)
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-gpu-serving-") as tmp:
        built = _build(Path(tmp))
        built_config = read_config(built / MODEL)
        assert built_config is not None
        lines.append(f"built config parameters: { {k: v.string_value for k, v in built_config.parameters.items()} }")
        print(lines[-1], flush=True)
        wanted = [p.strip() for p in args.only.split(";") if p.strip()]
        for variant in variants([int(n) for n in args.instances.split(",")]):
            if wanted and not any(variant.name.startswith(p) for p in wanted):
                continue
            repo = _variant_repo(built, Path(tmp) / f"repo-{len(records)}", variant)
            result = _measure(variant, repo, levels, args)
            for level in result.results:
                records.append(_record(variant, level))
                print(_row_text(records[-1]), flush=True)
    lines += ["", *_table(records), "", *_verdicts(records)]
    print("\n".join(lines[-(len(records) + 12):]))
    if args.output is not None:
        write_json(args.output, {"machine": info, "records": records})
        args.output.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    return 0


def _build(root: Path) -> Path:
    source = root / "resnet50.onnx"
    onnx.save(build_resnet50(0), str(source))
    repo = root / "built"
    started = time.perf_counter()
    report = build(source, repo / MODEL, BuildOptions(backend="torch", device="cuda", precision="fp16",
                                                      channels_last=True, max_batch_size=64, samples=8))
    print(f"build + verify: {time.perf_counter() - started:.1f} s, passed {report.passed}", flush=True)
    return repo


def _variant_repo(built: Path, repo: Path, variant: Variant) -> Path:
    shutil.copytree(built, repo)
    config = read_config(repo / MODEL)
    assert config is not None
    if not variant.batching:
        config.ClearField("dynamic_batching")
    else:
        config.dynamic_batching.max_queue_delay_microseconds = variant.delay_us
        if not variant.as_built:
            config.dynamic_batching.preferred_batch_size[:] = variant.preferred
    if not variant.as_built:
        del config.instance_group[:]
        config.instance_group.add(kind=pb.ModelInstanceGroup.KIND_GPU, count=variant.instances)
    if variant.fp16_inputs:
        for tensor in config.input:
            tensor.data_type = pb.TYPE_FP16
    for key, value in variant.parameters.items():
        config.parameters[key].string_value = value
    (repo / MODEL / "config.pbtxt").write_text(config_to_text(config))
    return repo


def _measure(variant: Variant, repo: Path, levels: tuple[int, ...], args: argparse.Namespace) -> BenchResult:
    before = sys.getswitchinterval()
    if variant.switch_interval_s is not None:
        sys.setswitchinterval(variant.switch_interval_s)
    try:
        concurrency = levels if variant.target == "direct" else tuple(c for c in levels if c > 1) or levels
        return run(BenchOptions(model=MODEL, target=variant.target, model_repository=repo, device="gpu",
                                concurrency=concurrency, measurement_interval_ms=args.window_ms,
                                max_trials=args.max_trials))
    finally:
        sys.setswitchinterval(before)


def _record(variant: Variant, level: LevelResult) -> dict[str, Any]:
    server = level.server_us
    return {"variant": variant.name, "target": variant.target, "batching": variant.batching,
            "instances": variant.instances or "as built", "delay_us": variant.delay_us,
            "switch_interval_s": variant.switch_interval_s, "preferred": list(variant.preferred),
            "fp16_inputs": variant.fp16_inputs, "concurrency": level.concurrency,
            "images_per_s": round(level.throughput_items_per_s, 1), "p50_ms": level.latency_ms.p50,
            "p99_ms": level.latency_ms.p99, "stable": level.stable, "errors": level.errors,
            "server_us": None if server is None else {"queue": server.queue, "compute_input": server.compute_input,
                                                      "compute_infer": server.compute_infer,
                                                      "compute_output": server.compute_output}}


def _row_text(record: dict[str, Any]) -> str:
    return (f"{record['variant']:<48} c={record['concurrency']:<3} {record['images_per_s']:>9,.0f} img/s  "
            f"p50 {record['p50_ms']:.2f} ms  p99 {record['p99_ms']:.2f} ms  stable {record['stable']}")


def _table(records: list[dict[str, Any]]) -> list[str]:
    direct = {r["concurrency"]: r["images_per_s"] for r in records if r["target"] == "direct"}
    rows = []
    for r in records:
        ratio = r["images_per_s"] / direct[r["concurrency"]] if direct.get(r["concurrency"]) else None
        server = r["server_us"]
        breakdown = "-" if server is None else "/".join(f"{server[k]:.0f}" for k in
                                                       ("queue", "compute_input", "compute_infer", "compute_output"))
        rows.append([r["variant"], r["concurrency"], f"{r['images_per_s']:,.0f}",
                     "-" if ratio is None else f"{ratio:.2f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
                     breakdown, "yes" if r["stable"] else "no"])
    return format_table(["variant", "conc", "img/s", "vs direct", "p50 ms", "p99 ms",
                         "server us queue/input/infer/output", "stable"], rows)


def _verdicts(records: list[dict[str, Any]]) -> list[str]:
    lines = ["## Bars"]
    for level, bar in BARS.items():
        served = [r for r in records if r["target"] == "inprocess" and r["batching"] and r["concurrency"] == level]
        plain = [r for r in served if r["switch_interval_s"] is None and r["delay_us"] == 0]
        for label, group in (("as built (delay 0, default GIL switch)", plain), ("any variant", served)):
            if not group:
                continue
            best = max(group, key=lambda r: r["images_per_s"])
            verdict = "met" if best["images_per_s"] >= bar else "NOT met"
            lines.append(f"served with batching, c={level}, {label}: best {best['images_per_s']:,.0f} img/s "
                         f"({best['variant']}) vs bar {bar:,.0f}: {verdict}")
    for level, reference in DIRECT_REFERENCE.items():
        got = [r for r in records if r["target"] == "direct" and r["concurrency"] == level]
        if got:
            lines.append(f"direct c={level}: {got[0]['images_per_s']:,.0f} img/s, "
                         f"{got[0]['images_per_s'] / reference:.2f} of plain PyTorch's {reference:,.0f}")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
