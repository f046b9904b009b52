"""The ``kiln`` command: argument parsing and wiring only."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from kiln.ab_cli import add_ab_arguments, run_ab
from kiln.advise.cli import add_advise_arguments, run_advise
from kiln.bench.cli import add_bench_arguments, run_bench
from kiln.bench.compare_cli import add_compare_arguments, run_compare
from kiln.capture_cli import add_capture_arguments, run_capture
from kiln.edge.cli import add_calibrate_arguments, add_edge_arguments, run_calibrate, run_edge
from kiln.errors import InvalidArgumentError, KilnError


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:2] == ["bench", "compare"]:  # `bench` takes a required -m, so compare is its own command
        arguments = ["bench-compare", *arguments[2:]]
    if arguments[:2] == ["edge", "calibrate"]:  # likewise: `edge` takes a model path
        arguments = ["edge-calibrate", *arguments[2:]]
    args = parser.parse_args(arguments)
    try:
        result: int = args.run(args)
    except KilnError as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 1
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Deploy neural-network inference.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo-repo", help="build the demo model repository (simple, mlp, simple_string, the mlp_pipeline "
                             "ensemble, optional resnet50)")
    demo.add_argument("path", type=Path, help="folder to write the repository into")
    demo.add_argument("--resnet50", action="store_true", help="also build resnet50 (random weights, ~100 MB)")
    demo.add_argument("--seed", type=int, default=0, help="weight seed (same seed, same bytes)")
    demo.set_defaults(run=_demo_repo)

    config = commands.add_parser("config", help="print a model folder's complete config as Triton renders it")
    config.add_argument("model_dir", type=Path, help="a model folder: <repository>/<model>")
    config.set_defaults(run=_config)

    _add_serve(commands.add_parser("serve", help="serve model repositories over HTTP and gRPC (default: the demo)"))
    _add_build(commands.add_parser("build", help="build an ONNX model into an optimized, verified model version"))
    bench = commands.add_parser("bench", help="measure a model: throughput, latency percentiles, server breakdown, "
                                              "memory")
    add_bench_arguments(bench)
    bench.set_defaults(run=run_bench)
    compare = commands.add_parser("bench-compare", prog="kiln bench compare",
                                  help="the reference experiment on one model (also `kiln bench compare`): direct "
                                       "vs served vs served beside other models, with a report")
    add_compare_arguments(compare)
    compare.set_defaults(run=run_compare)
    edge = commands.add_parser("edge", help="run a model at the edge: answer locally, route uncertain or anomalous "
                                            "requests to a cloud kiln server")
    add_edge_arguments(edge)
    edge.set_defaults(run=run_edge)
    calibrate = commands.add_parser("edge-calibrate", prog="kiln edge calibrate",
                                    help="write the calibration statistics the edge's range checks read (also "
                                         "`kiln edge calibrate`)")
    add_calibrate_arguments(calibrate)
    calibrate.set_defaults(run=run_calibrate)
    capture = commands.add_parser("capture", help="samples edges captured for retraining (kiln serve --capture-dir)")
    add_capture_arguments(capture)
    capture.set_defaults(run=run_capture)
    ab = commands.add_parser("ab", help="compare a model's versions under A/B routing and shadow traffic "
                                        "(kiln ab report MODEL)")
    add_ab_arguments(ab)
    ab.set_defaults(run=run_ab)
    advise = commands.add_parser("advise", help="direct engine, server or both: the decision rules, with measured "
                                                "evidence")
    add_advise_arguments(advise)
    advise.set_defaults(run=run_advise)
    return parser


def _add_build(build: argparse.ArgumentParser) -> None:
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
    build.add_argument("--compile-mode", default="none",
                       choices=["none", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                       help="torch backend: torch.compile mode applied when the engine loads")
    build.add_argument("--max-batch-size", type=int, default=None, help="default: 8 when the model has a dynamic "
                       "batch dimension, else 0")
    build.add_argument("--shapes", default=None, metavar="NAME:MIN/OPT/MAX,...",
                       help="shape ranges of dynamic inputs, e.g. input:1x3x224x224/8x3x224x224/16x3x224x224")
    build.add_argument("--atol", type=float, default=None, help="verification: absolute tolerance")
    build.add_argument("--rtol", type=float, default=None, help="verification: relative tolerance")
    build.add_argument("--min-top1", type=float, default=None, help="verification: least top-1 agreement (0-1)")
    build.add_argument("--seed", type=int, default=0, help="seed of generated samples")
    build.add_argument("--quiet", action="store_true", help="no progress display")
    build.set_defaults(run=_build)


def _build(args: argparse.Namespace) -> int:
    from kiln.build import BuildOptions, VerificationError, build

    shapes = {}
    if args.shapes:
        from kiln.build.shapes import parse_shapes

        shapes = parse_shapes(args.shapes)
    device = args.device or ("cuda" if args.backend == "tensorrt" else "cpu")
    options = BuildOptions(
        precision=args.precision, io_dtype=args.io_dtype, backend=args.backend, version=args.version,
        calibration_data=args.calibration_data, calibration_method=args.calibration_method, samples=args.samples,
        max_batch_size=args.max_batch_size, shapes=shapes,
        device=device, int8_types=args.int8_types, torch_format=args.torch_format, channels_last=args.channels_last,
        cuda_graphs=args.cuda_graphs, compile_mode=args.compile_mode, atol=args.atol,
        rtol=args.rtol, min_top1=args.min_top1, seed=args.seed, progress=not args.quiet,
    )
    try:
        report = build(args.model, args.output, options)
    except VerificationError as exc:
        print(exc.report.summary(), file=sys.stderr)
        raise
    print(report.summary())
    return 0


def _demo_repo(args: argparse.Namespace) -> int:
    from kiln.demo import build_demo_repository

    names = build_demo_repository(args.path, include_resnet50=args.resnet50, seed=args.seed)
    print(f"wrote {', '.join(names)} to {args.path}")
    return 0


def _config(args: argparse.Namespace) -> int:
    from kiln.config import config_to_json, open_model_dir

    spec = open_model_dir(args.model_dir).spec
    print(json.dumps(config_to_json(spec.config), indent=2))
    return 0


def _add_serve(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--model-repository", "--model-store", type=Path, action="append", default=None,
                       help="a model repository root (repeatable; default: the demo repository)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--grpc-port", type=int, default=8001)
    serve.add_argument("--metrics-port", type=int, default=8002)
    serve.add_argument("--allow-http", type=_bool, default=True, metavar="BOOL")
    serve.add_argument("--allow-grpc", type=_bool, default=True, metavar="BOOL")
    serve.add_argument("--allow-metrics", type=_bool, default=True, metavar="BOOL")
    serve.add_argument("--http-max-input-size", type=int, default=64 * 2**20, metavar="BYTES",
                       help="largest accepted HTTP request body (default 64 MiB)")
    serve.add_argument("--grpc-max-message-size", type=int, default=2**31 - 1, metavar="BYTES")
    serve.add_argument("--grpc-workers", type=_non_negative, default=0, metavar="N",
                       help="serve gRPC from N worker processes sharing the port, which forward each call to "
                            "this process (0, the default: gRPC runs in this process)")
    serve.add_argument("--strict-readiness", type=_bool, default=True, metavar="BOOL",
                       help="ready only when every model is ready (default true)")
    serve.add_argument("--exit-timeout-secs", type=float, default=30.0,
                       help="how long shutdown waits for in-flight requests (default 30)")
    serve.add_argument("--metrics-config", action="append", default=[], metavar="KEY=VALUE",
                       help="counter_latencies, summary_latencies, histogram_latencies (true/false), "
                            "summary_quantiles=0.5:0.05,0.9:0.01 (repeatable)")
    serve.add_argument("--allow-cpu-metrics", type=_bool, default=True, metavar="BOOL")
    serve.add_argument("--allow-gpu-metrics", type=_bool, default=True, metavar="BOOL")
    serve.add_argument("--model-control-mode", choices=["none", "poll", "explicit"], default="none",
                       help="none: load all at start; poll: also apply repository changes; explicit: only "
                            "--load-model at start, then the load/unload API")
    serve.add_argument("--repository-poll-secs", type=float, default=15.0, help="poll interval (poll mode)")
    serve.add_argument("--load-model", action="append", default=[], metavar="NAME",
                       help="explicit mode: load this model at start (repeatable; '*' = all)")
    serve.add_argument("--exit-on-error", type=_bool, default=True, metavar="BOOL",
                       help="exit when a model fails to load at start (default true)")
    serve.add_argument("--model-load-thread-count", type=int, default=4)
    serve.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                       help="cores shared by all CPU model instances that set no thread count (default: all)")
    serve.add_argument("--gil-switch-interval-us", type=int, default=None, metavar="US",
                       help="how long a thread may hold Python's GIL while another waits (default: Python's 5000); "
                            "a shorter one lets a worker that has waited for the GPU take it back sooner "
                            "(docs/pytorch-backend.md)")
    serve.add_argument("--allow-client-shm", type=_bool, nargs="?", const=True, default=False, metavar="BOOL",
                       help="let clients register system shared-memory regions and pass tensors in them "
                            "(default false: a client could make the server read and write any shared-memory "
                            "object the server's user can open)")
    serve.add_argument("--allow-model-download", action="store_true",
                       help="serve model version files with checksums to edges that sync (a kiln extension; "
                            "off by default)")
    serve.add_argument("--api-key", default=os.environ.get("KILN_API_KEY"), metavar="KEY",
                       help="bearer token the model-download and capture endpoints require (default: env "
                            "KILN_API_KEY)")
    serve.add_argument("--capture-dir", type=Path, default=None, metavar="DIR",
                       help="store samples edges capture for retraining in DIR (a kiln extension; off by default)")
    serve.add_argument("--capture-max-mb", type=int, default=1024, metavar="MB",
                       help="size bound of --capture-dir; the oldest samples are deleted past it (default 1024)")
    serve.add_argument("--https-certfile", type=Path, default=None, metavar="CERT",
                       help="serve the HTTP frontend over TLS with this PEM certificate (chain); gRPC and metrics "
                            "stay plain")
    serve.add_argument("--https-keyfile", type=Path, default=None, metavar="KEY",
                       help="the PEM private key of --https-certfile")
    serve.add_argument("--https-client-ca", type=Path, default=None, metavar="CA",
                       help="require HTTP clients to present a certificate signed by this CA (mTLS)")
    serve.add_argument("--log-verbose", type=int, default=0, help="0 = info, 1 or more = debug")
    serve.add_argument("--log-format", choices=["default", "ISO8601"], default="default")
    serve.set_defaults(run=_serve)


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got '{text}'") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value}")
    return value


def _bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{text}'")


def _configure_logging(verbose: int, log_format: str) -> None:
    date = "%Y-%m-%dT%H:%M:%S" if log_format == "ISO8601" else "%H:%M:%S"
    logging.basicConfig(level=logging.DEBUG if verbose > 0 else logging.INFO,
                        format="%(asctime)s %(levelname).1s %(name)s] %(message)s", datefmt=date)


def default_demo_repository() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kiln" / "demo-repository"


def _serve(args: argparse.Namespace) -> int:
    from kiln.frontends.metrics import parse_metrics_config
    from kiln.service import ServiceOptions, run_service

    _configure_logging(args.log_verbose, args.log_format)
    if args.load_model and args.model_control_mode != "explicit":
        raise InvalidArgumentError("--load-model needs --model-control-mode=explicit")
    if "*" in args.load_model and len(args.load_model) > 1:
        raise InvalidArgumentError("--load-model=* loads every model and must be the only --load-model")
    _check_https_flags(args)
    if args.gil_switch_interval_us is not None:
        set_switch_interval(args.gil_switch_interval_us)
    repositories = args.model_repository
    if repositories is None:
        from kiln.demo import build_demo_repository

        demo = default_demo_repository()
        names = build_demo_repository(demo)
        logging.getLogger("kiln").info("serving the demo repository %s (%s)", demo, ", ".join(names))
        repositories = [demo]
    metrics = dataclasses.replace(parse_metrics_config(args.metrics_config), cpu_metrics=args.allow_cpu_metrics,
                                  gpu_metrics=args.allow_gpu_metrics)
    options = ServiceOptions(
        repositories=repositories, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
        metrics_port=args.metrics_port, allow_http=args.allow_http, allow_grpc=args.allow_grpc,
        allow_metrics=args.allow_metrics, http_max_input_size=args.http_max_input_size,
        grpc_max_message_bytes=args.grpc_max_message_size, grpc_workers=args.grpc_workers,
        exit_timeout_s=args.exit_timeout_secs,
        strict_readiness=args.strict_readiness, cpu_threads=args.cpu_threads,
        control_mode=args.model_control_mode, load_models=tuple(args.load_model),
        repository_poll_secs=args.repository_poll_secs, exit_on_error=args.exit_on_error,
        model_load_thread_count=args.model_load_thread_count, allow_client_shm=args.allow_client_shm,
        allow_model_download=args.allow_model_download, api_key=args.api_key or None, metrics=metrics,
        capture_dir=args.capture_dir, capture_max_bytes=args.capture_max_mb * 2**20,
        https_certfile=args.https_certfile, https_keyfile=args.https_keyfile, https_client_ca=args.https_client_ca,
    )
    return run_service(options)


def set_switch_interval(microseconds: int) -> None:
    """Python's GIL switch interval for this process (``sys.setswitchinterval``), from --gil-switch-interval-us."""
    if microseconds <= 0:
        raise InvalidArgumentError(f"--gil-switch-interval-us must be a positive number of microseconds, got "
                                   f"{microseconds}")
    sys.setswitchinterval(microseconds / 1e6)
    logging.getLogger("kiln").info("GIL switch interval: %d us", microseconds)


def _check_https_flags(args: argparse.Namespace) -> None:
    if (args.https_keyfile is not None or args.https_client_ca is not None) and args.https_certfile is None:
        raise InvalidArgumentError("--https-keyfile and --https-client-ca need --https-certfile (the server's "
                                   "certificate)")
    for flag, path in (("--https-certfile", args.https_certfile), ("--https-keyfile", args.https_keyfile),
                       ("--https-client-ca", args.https_client_ca)):
        if path is not None and not path.is_file():
            raise InvalidArgumentError(f"{flag} '{path}' is not a file")


if __name__ == "__main__":
    sys.exit(main())
