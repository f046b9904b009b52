"""``kiln bench`` (measure one model: perf_analyzer's flag spellings where it has one) and its subcommand
``kiln bench compare`` (the reference experiment). Their flags are derived from BenchOptions and CompareOptions;
the flags declared here are the ones that combine into a field, and what the command does with the result."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from kiln.bench.compare import CompareOptions
from kiln.bench.options import BenchOptions, default_url, load_levels, parse_shape
from kiln.cli._arguments import add_flags, build
from kiln.errors import InvalidArgumentError
from kiln.service_options import ServiceOptions

if TYPE_CHECKING:
    from kiln.cli._arguments import Commands

GROUPS = ("load", "measurement", "input data", "direct target", "output")  # kiln bench's --help sections
COMPARE_HELP = ("the reference experiment on one model: direct vs served vs served beside other models, with a "
                "report")


def add_command(commands: Commands) -> None:
    bench = commands.add_parser("bench", help="measure a model: throughput, latency percentiles, server breakdown, "
                                              "memory")
    add_bench_arguments(bench)
    subcommands = bench.add_subparsers(dest="bench_command", metavar="{compare}")
    add_compare_arguments(subcommands.add_parser("compare", help=COMPARE_HELP))
    # The spelling from before `compare` was a subcommand.
    add_compare_arguments(commands.add_parser("bench-compare", prog="kiln bench compare",
                                              help=f"{COMPARE_HELP} (also `kiln bench compare`)"))


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    load = groups["load"]
    load.add_argument("--concurrency-range", default=None, metavar="START:END:STEP",
                      help="outstanding requests, swept (default 1; END 0: until --latency-threshold)")
    load.add_argument("--concurrency", default=None, metavar="N,N,...", help="explicit concurrency levels")
    load.add_argument("--request-rate-range", default=None, metavar="START:END:STEP",
                      help="requests per second, swept, instead of a concurrency")
    groups["input data"].add_argument("--shape", action="append", default=[], metavar="NAME:D1,D2,...",
                                      help="dims of an input's dynamic dimensions, batch excluded (repeatable)")
    output = groups["output"]
    output.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results as JSON")
    output.add_argument("--csv", type=Path, default=None, metavar="FILE",
                        help="write the results as CSV (perf_analyzer's columns first)")
    output.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    add_flags(parser, BenchOptions, groups)

    def run(args: argparse.Namespace) -> int:
        if args.model is None:  # not required by argparse, which would then ask for it after `compare` too
            parser.error("the following arguments are required: -m/--model")
        return run_bench(args)

    parser.set_defaults(run=run)


def bench_options(args: argparse.Namespace) -> BenchOptions:
    concurrency, rates = load_levels(args.concurrency_range, args.concurrency, args.request_rate_range,
                                     args.latency_threshold_ms)
    return build(BenchOptions, args, concurrency=concurrency, request_rates=rates,
                 shapes=dict(parse_shape(text) for text in args.shape),
                 url=default_url(args.target, args.url, args.model_repository))


def run_bench(args: argparse.Namespace) -> int:
    from kiln.bench.console import run_and_print

    run_and_print(bench_options(args), json_path=args.json, csv_path=args.csv, quiet=args.quiet)
    return 0


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, CompareOptions)
    parser.add_argument("--output", type=Path, default=None, metavar="DIR",
                        help="where compare.json, compare.md, the PNG plots and report.html go "
                             "(default ./kiln-compare-MODEL)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.set_defaults(run=run_compare)


def compare_options(args: argparse.Namespace) -> CompareOptions:
    options = build(CompareOptions, args)
    check_serve_args(options)
    return options


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise InvalidArgumentError(message)


def check_serve_args(options: CompareOptions) -> None:
    """--serve-args read as `kiln serve` reads them, so a mistake fails now rather than after the direct
    scenario has run for minutes."""
    words = options.serve_words()
    if not words:
        return
    parser = _RaisingParser(prog="kiln serve", add_help=False)
    add_flags(parser, ServiceOptions)
    try:
        served = build(ServiceOptions, parser.parse_args(["--model-repository", str(options.model_repository), *words]))
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"--serve-args '{options.serve_args}': kiln serve would refuse it: {exc}") from None
    unreachable = _unreachable(served, options.protocol)
    if unreachable:
        raise InvalidArgumentError(f"--serve-args '{options.serve_args}' {unreachable}; kiln bench compare waits for "
                                   f"the server, reads its statistics over plain HTTP and sends {options.protocol} "
                                   f"requests without credentials")


def _unreachable(served: ServiceOptions, protocol: str) -> str:
    """What in ``served`` would keep the comparison from reaching the server ('' when nothing does)."""
    if not served.allow_http:
        return "turns HTTP off"
    if served.https_certfile is not None or served.http_access:
        return "puts HTTP behind TLS or restricted APIs"
    if protocol == "grpc" and not served.allow_grpc:
        return "turns gRPC off"
    if protocol == "grpc" and (served.grpc_use_ssl or served.grpc_use_ssl_mutual or served.grpc_access):
        return "puts gRPC behind TLS or restricted protocols"
    return ""


def run_compare(args: argparse.Namespace) -> int:
    from kiln.bench.compare_run import run_and_report

    run_and_report(compare_options(args), args.output, quiet=args.quiet)
    return 0
