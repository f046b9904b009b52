"""``kiln ab report MODEL``: how a model's versions compare under A/B routing and shadow traffic (kiln/ab/)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.server.shadow import DEFAULT_ATOL, DEFAULT_RTOL

if TYPE_CHECKING:
    from kiln.cli._arguments import Commands


def add_command(commands: Commands) -> None:
    ab = commands.add_parser("ab", help="compare a model's versions under A/B routing and shadow traffic "
                                        "(kiln ab report MODEL)")
    subcommands = ab.add_subparsers(dest="ab_command", required=True)
    report = subcommands.add_parser("report", help="per-version counts, latency percentiles and agreement")
    report.add_argument("model", help="the model to report on")
    report.add_argument("-u", "--url", default="localhost:8000", help="the server's HTTP address (default "
                                                                      "localhost:8000)")
    report.add_argument("--capture-dir", type=Path, default=None, metavar="DIR",
                        help="kiln serve's --capture-dir: also compare the versions' captured answers")
    report.add_argument("--atol", type=float, default=DEFAULT_ATOL, help="absolute tolerance for captured answers")
    report.add_argument("--rtol", type=float, default=DEFAULT_RTOL, help="relative tolerance for captured answers")
    report.add_argument("--json", action="store_true", help="print the report as JSON")
    report.set_defaults(run=run_report)


def run_report(args: argparse.Namespace) -> int:
    from kiln.ab import build_report, print_report

    report = build_report(args.url, args.model, args.capture_dir, args.atol, args.rtol)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_report(report, sys.stdout)
    return 0
