"""``kiln demo-repo``: write the demo model repository."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.cli._arguments import Commands


def add_command(commands: Commands) -> None:
    parser = commands.add_parser(
        "demo-repo", help="build the demo model repository (simple, mlp, simple_string, the mlp_pipeline ensemble, "
                          "the models of Triton's example clients, optional resnet50)")
    parser.add_argument("path", type=Path, help="folder to write the repository into")
    parser.add_argument("--resnet50", action="store_true", help="also build resnet50 (random weights, ~100 MB)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (same seed, same bytes)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kiln.demo import build_demo_repository

    names = build_demo_repository(args.path, include_resnet50=args.resnet50, seed=args.seed)
    print(f"wrote {', '.join(names)} to {args.path}")
    return 0
