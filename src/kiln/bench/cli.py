"""``kiln bench``: its arguments (perf_analyzer's spellings where it has one) and the command itself."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.bench.options import (
    DEFAULT_MEASUREMENT_INTERVAL_MS,
    DISTRIBUTIONS,
    TARGETS,
    TENSOR_FORMATS,
    BenchOptions,
    parse_list,
    parse_range,
    parse_shape,
)
from kiln.bench.progress import Progress
from kiln.bench.result import LevelResult
from kiln.bench.runner import run
from kiln.bench.table import header, level_block, summary
from kiln.errors import InvalidArgumentError

DEFAULT_URLS = {"http": "localhost:8000", "grpc": "localhost:8001"}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", required=True, help="model name (direct: also a model file or folder)")
    parser.add_argument("-x", "--model-version", default="", help="model version (default: the newest served)")
    parser.add_argument("--target", choices=TARGETS, default="http",
                        help="direct: kiln.load in this process, N threads; inprocess: kiln.Server in this "
                             "process, no network; http / grpc: a KServe V2 server (default http)")
    parser.add_argument("-u", "--url", default=None, help="http/grpc server host:port (default localhost:8000 / "
                        "localhost:8001; with --model-repository and no URL, kiln bench starts `kiln serve`)")
    parser.add_argument("--model-repository", type=Path, default=None,
                        help="repository holding the model (inprocess; direct: <repo>/<model>; http/grpc without "
                             "-u: the repository of the `kiln serve` kiln bench starts)")
    load = parser.add_argument_group("load")
    load.add_argument("--concurrency-range", default=None, metavar="START:END:STEP",
                      help="outstanding requests, swept (default 1; END 0: until --latency-threshold)")
    load.add_argument("--concurrency", default=None, metavar="N,N,...", help="explicit concurrency levels")
    load.add_argument("--request-rate-range", default=None, metavar="START:END:STEP",
                      help="requests per second, swept, instead of a concurrency")
    load.add_argument("--request-distribution", choices=DISTRIBUTIONS, default="constant",
                      help="gaps between request-rate sends (default constant)")
    load.add_argument("--client-processes", type=int, default=1, metavar="N",
                      help="http/grpc: send from N processes sharing each concurrency level (one Python process "
                           "cannot send large tensors as fast as a server can take them)")
    load.add_argument("--max-outstanding", type=int, default=64,
                      help="request-rate mode: sends due while this many are in flight are dropped (default 64)")
    load.add_argument("-l", "--latency-threshold", type=float, default=None, metavar="MS",
                      help="stop the sweep after a level whose average latency exceeds this")
    measure = parser.add_argument_group("measurement")
    measure.add_argument("-p", "--measurement-interval", type=int, default=DEFAULT_MEASUREMENT_INTERVAL_MS,
                         metavar="MS", help=f"window length (default {DEFAULT_MEASUREMENT_INTERVAL_MS})")
    measure.add_argument("-s", "--stability-percentage", type=float, default=10.0,
                         help="last 3 windows within this %% on throughput and latency = stable (default 10)")
    measure.add_argument("-r", "--max-trials", type=int, default=10, help="most windows per level (default 10)")
    data = parser.add_argument_group("input data")
    data.add_argument("-b", "--batch-size", type=int, default=1, help="batch size of each request (default 1)")
    data.add_argument("--input-data", default="random", metavar="random|zero|FILE",
                      help="random (default), zero, a .npz (one array per input, samples first) or "
                           "perf_analyzer's .json format")
    data.add_argument("--shape", action="append", default=[], metavar="NAME:D1,D2,...",
                      help="dims of an input's dynamic dimensions, batch excluded (repeatable)")
    data.add_argument("--input-tensor-format", choices=TENSOR_FORMATS, default="binary", help="http only")
    data.add_argument("--output-tensor-format", choices=TENSOR_FORMATS, default="binary", help="http only")
    data.add_argument("--seed", type=int, default=0, help="seed of random data and poisson gaps")
    direct = parser.add_argument_group("direct target")
    direct.add_argument("--device", choices=["config", "cpu", "gpu"], default="config",
                        help="where the engine runs (config: where the model's instance group puts it)")
    direct.add_argument("--intra-op-threads", type=int, default=None, help="engine threads per request")
    output = parser.add_argument_group("output")
    output.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results as JSON")
    output.add_argument("--csv", type=Path, default=None, metavar="FILE",
                        help="write the results as CSV (perf_analyzer's columns first)")
    output.add_argument("--server-pid", type=int, default=None,
                        help="http/grpc: the server process whose memory to sample (default: found on localhost)")
    output.add_argument("--quiet", action="store_true", help="no progress line on stderr")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    concurrency: tuple[int, ...] = ()
    rates: tuple[float, ...] = ()
    given = [flag for flag, value in (("--concurrency-range", args.concurrency_range),
                                      ("--concurrency", args.concurrency),
                                      ("--request-rate-range", args.request_rate_range)) if value]
    if len(given) > 1:
        raise InvalidArgumentError(f"{' and '.join(given)} both set the load; give one of them")
    if args.concurrency_range:
        sweep = parse_range(args.concurrency_range, "--concurrency-range", integer=True)
        _check_open_ended(sweep.open_ended, args.latency_threshold, "--concurrency-range")
        concurrency = tuple(int(v) for v in sweep.values())
    elif args.concurrency:
        concurrency = parse_list(args.concurrency, "--concurrency")
    elif args.request_rate_range:
        sweep = parse_range(args.request_rate_range, "--request-rate-range", integer=False)
        _check_open_ended(sweep.open_ended, args.latency_threshold, "--request-rate-range")
        rates = tuple(sweep.values())
    url = args.url
    if url is None and args.target in DEFAULT_URLS and args.model_repository is None:
        url = DEFAULT_URLS[args.target]
    return BenchOptions(
        model=args.model, target=args.target, url=url, model_repository=args.model_repository,
        model_version=args.model_version, concurrency=concurrency, request_rates=rates,
        request_distribution=args.request_distribution, latency_threshold_ms=args.latency_threshold,
        measurement_interval_ms=args.measurement_interval, stability_percentage=args.stability_percentage,
        max_trials=args.max_trials, batch_size=args.batch_size, input_data=args.input_data,
        shapes=dict(parse_shape(text) for text in args.shape), input_tensor_format=args.input_tensor_format,
        output_tensor_format=args.output_tensor_format, max_outstanding=args.max_outstanding,
        server_pid=args.server_pid, device=args.device, intra_op_threads=args.intra_op_threads,
        client_processes=args.client_processes, seed=args.seed)


def _check_open_ended(open_ended: bool, threshold: float | None, flag: str) -> None:
    if open_ended and threshold is None:
        raise InvalidArgumentError(f"{flag} ends in 0, which sweeps until --latency-threshold; set it (ms)")


def run_bench(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    progress = Progress(enabled=not args.quiet, stability_percentage=options.stability_percentage,
                        max_trials=options.max_trials)

    def show(level: LevelResult) -> None:
        print(level_block(level), flush=True)

    print(header(options), flush=True)
    result = run(options, progress, on_level=show)
    print(summary(result), end="")
    if args.json is not None:
        result.write_json(args.json)
    if args.csv is not None:
        result.write_csv(args.csv)
    unstable = [level for level in result.results if not level.stable]
    if unstable:
        print(f"kiln bench: {len(unstable)} level(s) did not stabilize within {options.max_trials} windows; "
              f"raise --max-trials or --measurement-interval", file=sys.stderr)
    return 0
