"""``python -m kiln.edge [calibrate] ...``: the ``kiln edge`` commands, runnable on their own."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kiln.edge.cli import add_calibrate_arguments, add_edge_arguments, run_calibrate, run_edge
from kiln.errors import KilnError


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    calibrate = arguments[:1] == ["calibrate"]
    parser = argparse.ArgumentParser(prog="kiln edge" + (" calibrate" if calibrate else ""))
    (add_calibrate_arguments if calibrate else add_edge_arguments)(parser)
    args = parser.parse_args(arguments[1:] if calibrate else arguments)
    try:
        return run_calibrate(args) if calibrate else run_edge(args)
    except KilnError as exc:
        print(f"kiln edge: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
