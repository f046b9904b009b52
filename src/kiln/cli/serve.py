"""``kiln serve``: its flags are derived from the ServiceOptions declarations (kiln/service_options.py)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.cli._arguments import add_flags, build
from kiln.errors import InvalidArgumentError
from kiln.service_options import ServiceOptions

if TYPE_CHECKING:
    from kiln.cli._arguments import Commands

log = logging.getLogger("kiln")


def add_command(commands: Commands) -> None:
    parser = commands.add_parser("serve", help="serve model repositories over HTTP and gRPC (default: the demo)")
    add_flags(parser, ServiceOptions)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kiln.service import run_service

    options = build(ServiceOptions, args)
    configure_logging(options.log_verbose, options.log_format)
    if options.gil_switch_interval_us is not None:
        set_switch_interval(options.gil_switch_interval_us)
    if not options.server.repositories:
        options = with_demo_repository(options)
    return run_service(options)


def with_demo_repository(options: ServiceOptions) -> ServiceOptions:
    """``options`` serving the demo repository, built (or refreshed) in the user's cache."""
    from kiln.demo import build_demo_repository

    demo = default_demo_repository()
    names = build_demo_repository(demo)
    log.info("serving the demo repository %s (%s)", demo, ", ".join(names))
    return dataclasses.replace(options, server=dataclasses.replace(options.server, repositories=[demo]))


def default_demo_repository() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kiln" / "demo-repository"


def configure_logging(verbose: int, log_format: str) -> None:
    date = "%Y-%m-%dT%H:%M:%S" if log_format == "ISO8601" else "%H:%M:%S"
    logging.basicConfig(level=logging.DEBUG if verbose > 0 else logging.INFO,
                        format="%(asctime)s %(levelname).1s %(name)s] %(message)s", datefmt=date)


def set_switch_interval(microseconds: int) -> None:
    """Python's GIL switch interval for this process (``sys.setswitchinterval``), from --gil-switch-interval-us."""
    if microseconds <= 0:
        raise InvalidArgumentError(f"--gil-switch-interval-us must be a positive number of microseconds, got "
                                   f"{microseconds}")
    sys.setswitchinterval(microseconds / 1e6)
    log.info("GIL switch interval: %d us", microseconds)
