"""The ``kiln`` command. One module per command, each wiring only: it declares or derives its flags, builds one
options object from them and calls the library. ``python -m kiln.cli`` runs the same command (kiln starts
``kiln serve`` child processes that way: kiln/serve_process.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kiln.cli import ab, advise, bench, build, capture, cluster, config, demo_repo, edge, serve
from kiln.cli._arguments import CommandParser
from kiln.errors import KilnError

__all__ = ["main", "make_parser"]

COMMANDS = (demo_repo, config, serve, cluster, build, bench, edge, capture, ab, advise)  # in --help order


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kiln`` with ``argv`` (default: this process's arguments); a kiln error is printed, status 1."""
    parser = make_parser()
    try:
        args = parser.parse_args(argv)
        result: int = args.run(args)
    except KilnError as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 1
    return result


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Deploy neural-network inference.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    for command in COMMANDS:
        command.add_command(commands)
    return parser
