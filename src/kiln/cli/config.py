"""``kiln config``: a model folder's complete config, as Triton renders it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.cli._arguments import Commands


def add_command(commands: Commands) -> None:
    parser = commands.add_parser("config", help="print a model folder's complete config as Triton renders it")
    parser.add_argument("model_dir", type=Path, help="a model folder: <repository>/<model>")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kiln.config import config_to_json, open_model_dir

    spec = open_model_dir(args.model_dir).spec
    print(json.dumps(config_to_json(spec.config), indent=2))
    return 0
