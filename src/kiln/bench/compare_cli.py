"""``kiln bench compare``: its arguments and the command (run the comparison, write the report)."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from kiln.bench.compare import PROTOCOLS, CompareOptions, Comparison
from kiln.bench.options import parse_list
from kiln.bench.report import comparison_table, markdown_table, memory_table, write_report

BATCHING = {"both": (False, True), "on": (True,), "off": (False,)}


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="the model to measure: a folder name in --model-repository")
    parser.add_argument("--model-repository", type=Path, required=True, metavar="REPO",
                        help="the repository holding MODEL (left untouched: served scenarios use temporary "
                             "repositories that link its files)")
    parser.add_argument("--concurrency", default="1,8,16", metavar="N,N,...",
                        help="concurrency levels, for every scenario (default 1,8,16)")
    parser.add_argument("--models", type=int, default=3, metavar="N",
                        help="other models served beside MODEL, copies of it all receiving traffic (default 3)")
    parser.add_argument("--output", type=Path, default=None, metavar="DIR",
                        help="where compare.json, compare.md, the PNG plots and report.html go "
                             "(default ./kiln-compare-MODEL)")
    parser.add_argument("--protocol", choices=PROTOCOLS, default="http",
                        help="how served scenarios are reached (default http, binary tensors: the faster of the "
                             "two through kiln's Python clients)")
    parser.add_argument("--batching", choices=sorted(BATCHING), default="both",
                        help="served scenarios with dynamic_batching on, off, or both (default both)")
    measure = parser.add_argument_group("measurement (short by default; raise them for publishable figures)")
    measure.add_argument("-p", "--measurement-interval", type=int, default=1000, metavar="MS",
                         help="window length (default 1000)")
    measure.add_argument("-r", "--max-trials", type=int, default=5, help="most windows per level (default 5)")
    measure.add_argument("-s", "--stability-percentage", type=float, default=10.0,
                         help="last 3 windows within this %% = stable (default 10)")
    measure.add_argument("--device", choices=["config", "cpu", "gpu"], default="config",
                         help="direct: where the engine runs (config: where its instance group puts it)")
    measure.add_argument("--client-processes", type=int, default=1, metavar="N",
                         help="served scenarios: send the measured model's requests, and each peer's, from N "
                              "processes (large tensors: one Python client process is slower than the server)")
    measure.add_argument("--seed", type=int, default=0, help="seed of the random input data")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def options_from_args(args: argparse.Namespace) -> CompareOptions:
    return CompareOptions(
        model=args.model, model_repository=args.model_repository,
        concurrency=parse_list(args.concurrency, "--concurrency"), models=args.models, protocol=args.protocol,
        batching=BATCHING[args.batching], measurement_interval_ms=args.measurement_interval,
        max_trials=args.max_trials, stability_percentage=args.stability_percentage, device=args.device,
        client_processes=args.client_processes, seed=args.seed)


def command_line(args: argparse.Namespace) -> list[str]:
    """The command that repeats this comparison, every setting spelled out."""
    return ["kiln", "bench", "compare", args.model, "--model-repository", str(args.model_repository),
            "--concurrency", args.concurrency, "--models", str(args.models), "--protocol", args.protocol,
            "--batching", args.batching, "-p", str(args.measurement_interval), "-r", str(args.max_trials),
            "-s", f"{args.stability_percentage:g}", "--device", args.device,
            "--client-processes", str(args.client_processes), "--seed", str(args.seed)]


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises SystemExit, so the servers and load processes are stopped as on Ctrl-C."""
    def handle(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_compare(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    output: Path = args.output if args.output is not None else Path(f"kiln-compare-{options.model}")

    def note(text: str) -> None:
        if not args.quiet:
            print(f"kiln bench compare: {text}", file=sys.stderr, flush=True)

    def partial(doc: dict[str, Any]) -> None:
        write_report(doc, output, command_line(args))
        note(f"partial report written to {output} ({len(doc['scenarios'])} scenario(s) so far)")

    with _sigterm_unwinds():
        doc = Comparison(options, note).run(on_progress=partial)
    written = write_report(doc, output, command_line(args))
    print(markdown_table(comparison_table(doc)))
    print(markdown_table(memory_table(doc)))
    print(f"report: {shlex.quote(str(written['report.html']))} (with compare.json, compare.md and the plots)")
    return 0
