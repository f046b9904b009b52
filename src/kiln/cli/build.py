"""``kiln build``: build an ONNX model into an optimized, verified model version."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.cli._arguments import Commands


def add_command(commands: Commands) -> None:
    parser = commands.add_parser("build", help="build an ONNX model into an optimized, verified model version")
    add_arguments(parser)
    parser.set_defaults(run=run)


def add_arguments(build: argparse.ArgumentParser) -> None:
    build.add_argument("model", type=Path, help="the ONNX model file to build from")
    build.add_argument("--output", "-o", type=Path, required=True, metavar="REPO/NAME",
                       help="the model folder in a repository; the build becomes a new version in it")
    build.add_argument("--version", type=int, default=None, help="version number (default: the next free one)")
    build.add_argument("--precision", choices=["fp32", "fp16", "bf16", "int8"], default="fp32")
    build.add_argument("--io-dtype", choices=["model", "fp16", "bf16"], default="model",
                       help="torch backend: declare the model's FP32 inputs and outputs as FP16/BF16 in the config "
                            "(needs the same --precision); requests then carry half the bytes")
    build.add_argument("--backend", choices=["onnxruntime", "torch", "tensorrt"], default="onnxruntime")
    build.add_argument("--device", choices=["cpu", "cuda"], default=None,
                       help="where the built engine runs (default: cpu; cuda for tensorrt)")
    build.add_argument("--calibration-data", type=Path, default=None, metavar="DIR|FILE.npz",
                       help="inputs for INT8 calibration and verification: one array per input name, samples "
                            "first (default: random samples)")
    build.add_argument("--calibration-method", choices=["minmax", "entropy", "percentile"], default="minmax")
    build.add_argument("--samples", type=int, default=32, help="random samples when no data is given (default 32)")
    build.add_argument("--int8-types", choices=["u8s8", "s8s8"], default=None,
                       help="INT8 activation/weight types (default: what fuses on this CPU)")
    build.add_argument("--torch-format", choices=["export", "aoti", "torchscript"], default="export",
                       help="torch backend: model.pt2 (torch.export, default), model.pt2 compiled by AOTInductor, "
                            "or model.pt (TorchScript, deprecated by PyTorch; what Triton's PyTorch backend loads)")
    build.add_argument("--channels-last", action="store_true", help="torch backend: NHWC memory layout (GPU convs)")
    build.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                       help="torch backend: one CUDA graph per batch size (default: on with --device cuda)")
    build.add_argument("--compile-mode", default="auto",
                       choices=["auto", "none", "default", "reduce-overhead", "max-autotune",
                                "max-autotune-no-cudagraphs"],
                       help="torch backend: torch.compile mode applied when the engine loads (default auto: on "
                            "--device cuda, the eager and the compiled engine are timed and the faster kept; none "
                            "on the CPU); a compiled build keeps compile_cache.bin so that loading skips compiling")
    build.add_argument("--max-batch-size", type=int, default=None, help="default: 8 when the model has a dynamic "
                       "batch dimension, else 0")
    build.add_argument("--shapes", default=None, metavar="NAME:MIN/OPT/MAX,...",
                       help="shape ranges of dynamic inputs, e.g. input:1x3x224x224/8x3x224x224/16x3x224x224")
    build.add_argument("--atol", type=float, default=None, help="verification: absolute tolerance")
    build.add_argument("--rtol", type=float, default=None, help="verification: relative tolerance")
    build.add_argument("--min-top1", type=float, default=None, help="verification: least top-1 agreement (0-1)")
    build.add_argument("--seed", type=int, default=0, help="seed of generated samples")
    build.add_argument("--quiet", action="store_true", help="no progress display")


def run(args: argparse.Namespace) -> int:
    from kiln.build import BuildOptions, VerificationError, build
    from kiln.build.shapes import parse_shapes

    options = BuildOptions(
        precision=args.precision, io_dtype=args.io_dtype, backend=args.backend, version=args.version,
        calibration_data=args.calibration_data, calibration_method=args.calibration_method, samples=args.samples,
        max_batch_size=args.max_batch_size, shapes=parse_shapes(args.shapes) if args.shapes else {},
        device=args.device or ("cuda" if args.backend == "tensorrt" else "cpu"), int8_types=args.int8_types,
        torch_format=args.torch_format, channels_last=args.channels_last, cuda_graphs=args.cuda_graphs,
        compile_mode=args.compile_mode, atol=args.atol, rtol=args.rtol, min_top1=args.min_top1, seed=args.seed,
        progress=not args.quiet,
    )
    try:
        report = build(args.model, args.output, options)
    except VerificationError as exc:
        print(exc.report.summary(), file=sys.stderr)
        raise
    print(report.summary())
    return 0
