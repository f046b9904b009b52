"""``kiln capture export``: the samples edges captured, as one npz plus a JSON index (kiln/capture/)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.cli._arguments import Commands


def add_command(commands: Commands) -> None:
    capture = commands.add_parser("capture", help="samples edges captured for retraining (kiln serve --capture-dir)")
    subcommands = capture.add_subparsers(dest="capture_command", required=True)
    export = subcommands.add_parser("export", help="write a model's captured samples as one npz plus a JSON index")
    export.add_argument("--capture-dir", type=Path, required=True, metavar="DIR", help="kiln serve's --capture-dir")
    export.add_argument("--model", required=True, help="the model whose samples to export")
    export.add_argument("--version", default=None, help="one version only (default: every version, oldest first)")
    export.add_argument("--output", "-o", type=Path, required=True, metavar="FILE.npz", help="where to write")
    export.set_defaults(run=run_export)


def run_export(args: argparse.Namespace) -> int:
    from kiln.capture import export_samples, index_path

    index = export_samples(args.capture_dir, args.model, args.version, args.output)
    print(f"exported {len(index)} samples of model '{args.model}' to {args.output} (index "
          f"{index_path(args.output)})")
    return 0
