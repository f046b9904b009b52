"""``kiln edge`` (serve a model at the edge, routing to the cloud; flags derived from EdgeOptions) and
``kiln edge calibrate`` (write the calibration statistics the range checks read)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.cli._arguments import add_flags, build
from kiln.edge.options import EdgeOptions

if TYPE_CHECKING:
    from kiln.cli._arguments import Commands

CALIBRATE_HELP = "write the calibration statistics the edge's range checks read"


def add_command(commands: Commands) -> None:
    edge = commands.add_parser("edge", help="run a model at the edge: answer locally, route uncertain or anomalous "
                                            "requests to a cloud kiln server",
                               epilog=f"kiln edge calibrate SAMPLES -o STATS.npz: {CALIBRATE_HELP} (kiln edge "
                                      f"calibrate --help)")
    add_flags(edge, EdgeOptions)
    edge.set_defaults(run=run_edge)
    add_calibrate_arguments(edge.add_subcommand("calibrate", description=CALIBRATE_HELP))
    # The spelling from before `calibrate` was a subcommand.
    add_calibrate_arguments(commands.add_parser("edge-calibrate", prog="kiln edge calibrate",
                                                help=f"{CALIBRATE_HELP} (also `kiln edge calibrate`)"))


def edge_options(args: argparse.Namespace) -> EdgeOptions:
    return build(EdgeOptions, args)


def run_edge(args: argparse.Namespace) -> int:
    from kiln.edge.serve import serve_edge

    serve_edge(edge_options(args))
    return 0


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("samples", type=Path, help="an .npz of samples: one array per input, samples first")
    parser.add_argument("--output", "-o", type=Path, required=True, metavar="STATS.npz",
                        help="where to write the statistics")
    parser.set_defaults(run=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    from kiln.edge.calibration import write_calibration

    stats = write_calibration(args.samples, args.output)
    for name, s in stats.inputs.items():
        print(f"{name}: {s.mean.size} features, mean {s.mean.mean():.4g}, std {s.std.mean():.4g}, "
              f"range [{s.minimum.min():.4g}, {s.maximum.max():.4g}]")
    print(f"wrote {args.output}")
    return 0
