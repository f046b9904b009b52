"""The ``kiln`` command: argument parsing and wiring only."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kiln.errors import KilnError

DEFAULT_DEMO_REPOSITORY = Path(".kiln/demo-repository")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.run(args)
    except KilnError as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 1
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Deploy neural-network inference.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo-repo", help="build the demo model repository (simple, mlp, optional resnet50)")
    demo.add_argument("path", type=Path, help="folder to write the repository into")
    demo.add_argument("--resnet50", action="store_true", help="also build resnet50 (random weights, ~100 MB)")
    demo.add_argument("--seed", type=int, default=0, help="weight seed (same seed, same bytes)")
    demo.set_defaults(run=_demo_repo)

    config = commands.add_parser("config", help="print a model folder's complete config as Triton renders it")
    config.add_argument("model_dir", type=Path, help="a model folder: <repository>/<model>")
    config.set_defaults(run=_config)

    serve = commands.add_parser("serve", help="serve a model repository (default: the demo repository)")
    serve.add_argument("--model-repository", type=Path, action="append", default=None)
    serve.set_defaults(run=_serve)
    return parser


def _demo_repo(args: argparse.Namespace) -> int:
    from kiln.demo import build_demo_repository

    names = build_demo_repository(args.path, include_resnet50=args.resnet50, seed=args.seed)
    print(f"wrote {', '.join(names)} to {args.path}")
    return 0


def _config(args: argparse.Namespace) -> int:
    from kiln.config import config_to_json, open_model_dir

    spec = open_model_dir(args.model_dir).spec
    print(json.dumps(config_to_json(spec.config), indent=2))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from kiln.demo import build_demo_repository

    if args.model_repository is None:
        names = build_demo_repository(DEFAULT_DEMO_REPOSITORY)
        print(f"built the demo repository ({', '.join(names)}) in {DEFAULT_DEMO_REPOSITORY}")
    print("kiln serve: the server is not part of this build yet; the repository is ready for it.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
