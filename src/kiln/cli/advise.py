"""``kiln advise``: direct engine, server or both; flags derived from AdviseOptions (kiln/advise/run.py)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from kiln.advise.run import AdviseOptions, run_advise
from kiln.cli._arguments import add_flags, build

if TYPE_CHECKING:
    from kiln.cli._arguments import Commands


def add_command(commands: Commands) -> None:
    parser = commands.add_parser("advise", help="direct engine, server or both: the decision rules, with measured "
                                                "evidence")
    add_flags(parser, AdviseOptions)
    parser.set_defaults(run=run)


def advise_options(args: argparse.Namespace) -> AdviseOptions:
    return build(AdviseOptions, args)


def run(args: argparse.Namespace) -> int:
    return run_advise(advise_options(args))
