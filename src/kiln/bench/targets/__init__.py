"""Bench targets, one per way of reaching a model; each module is imported only when its target is used."""

from __future__ import annotations

import importlib

from kiln.bench.options import BenchOptions
from kiln.bench.targets.base import RequestFailedError, Target

_TARGETS = {
    "direct": "kiln.bench.targets.direct:direct_target",
    "inprocess": "kiln.bench.targets.inprocess:InProcessTarget",
    "http": "kiln.bench.targets.kserve_http:HttpTarget",
    "grpc": "kiln.bench.targets.kserve_grpc:GrpcTarget",
}


def create_target(options: BenchOptions) -> Target:
    module_name, name = _TARGETS[options.target].split(":")
    target: Target = getattr(importlib.import_module(module_name), name)(options)
    if options.client_processes > 1:
        from kiln.bench.targets.processes import ProcessesTarget

        return ProcessesTarget(options, target, options.client_processes)
    return target


__all__ = ["RequestFailedError", "Target", "create_target"]
