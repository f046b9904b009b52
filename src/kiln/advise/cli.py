"""``kiln advise``: the flags, and the run that prints the recommendation."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from kiln.advise.advise import advise
from kiln.advise.compare_file import load_compare
from kiln.advise.evidence import derive
from kiln.advise.inputs import UPDATE_FREQUENCIES, parse_budget, parse_count, parse_frequency
from kiln.advise.prompt import Given, resolve
from kiln.advise.rules import render_rules, rules_as_json
from kiln.errors import InvalidArgumentError


def add_advise_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--latency-budget-ms", type=_checked(parse_budget), default=None, metavar="MS|none",
                        help="the p99 latency the caller can afford, in ms ('none': no budget)")
    parser.add_argument("--models", type=_checked(lambda text: parse_count(text, "models")), default=None,
                        metavar="N", help="how many models the service hosts")
    parser.add_argument("--update-frequency", type=_checked(parse_frequency), default=None,
                        metavar="|".join(UPDATE_FREQUENCIES), help="how often a new model version ships")
    parser.add_argument("--concurrency", type=_checked(lambda text: parse_count(text, "concurrency")), default=None,
                        metavar="N", help="requests in flight at once; picks the measured row the evidence rules "
                                          "read (default 1)")
    parser.add_argument("--evidence", type=Path, default=None, metavar="FILE",
                        help="a `kiln bench compare` JSON result: measured p99, throughput and memory")
    parser.add_argument("--json", action="store_true", help="print the recommendation as JSON")
    parser.add_argument("--rules", action="store_true", help="print the rule table and exit")
    parser.add_argument("--no-input", action="store_true",
                        help="never prompt: inputs not given take their defaults (the answer lists them)")


def _checked(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type that checks the text with the prompt's parser and keeps the text (parsed once, later)."""
    def check(text: str) -> str:
        try:
            parse(text)
        except InvalidArgumentError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text
    return check


def run_advise(args: argparse.Namespace, *, stdin: TextIO | None = None, stdout: TextIO | None = None,
               stderr: TextIO | None = None) -> int:
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    if args.rules:
        stdout.write((json.dumps(rules_as_json(), indent=2) if args.json else render_rules()) + "\n")
        return 0
    compare = load_compare(args.evidence) if args.evidence is not None else None
    given = Given(latency_budget_ms=args.latency_budget_ms, models=args.models,
                  update_frequency=args.update_frequency, concurrency=args.concurrency)
    interactive = not args.no_input and stdin.isatty()
    # Questions go to stderr so that --json output on stdout stays parseable.
    inputs, assumed = resolve(given, interactive=interactive, ask_concurrency=compare is not None, stdin=stdin,
                              stdout=stderr)
    evidence = derive(compare, inputs) if compare is not None else None
    recommendation = advise(inputs, evidence, assumed)
    if args.json:
        stdout.write(json.dumps(recommendation.as_dict(), indent=2) + "\n")
    else:
        stdout.write(recommendation.render() + "\n")
    return 0
