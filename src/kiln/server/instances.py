"""Create a model version's engine instances from its instance groups."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from kiln.config.spec import ModelSpec
from kiln.engines.base import Engine, EngineOptions, ModelCaller, create_engine, instance_group_options
from kiln.v2._generated import model_config_pb2 as pb

# Config parameters with which a model sets its own thread counts (onnxruntime and PyTorch backends).
_THREAD_PARAMETERS = ("intra_op_thread_count", "inter_op_thread_count", "num_threads")
# Backends without an intra-op thread pool (Python models run in the caller's thread; ensembles only route).
_NO_THREAD_POOL = ("python", "ensemble")


def cpu_instance_count(spec: ModelSpec) -> int:
    return sum(g.count for g in spec.config.instance_group if g.kind != pb.ModelInstanceGroup.KIND_GPU)


def cpu_thread_share(cpu_threads: int | None, models: list[tuple[ModelSpec, int]]) -> int | None:
    """Threads per CPU instance so that all instances together stay within the machine's cores.

    ``models`` pairs each spec with its number of served versions. Models that set their own thread counts
    are not counted. With a single instance in all, None lets the engine use every core.
    """
    budget = cpu_threads or os.cpu_count() or 1
    instances = sum(cpu_instance_count(spec) * versions for spec, versions in models
                    if spec.backend not in _NO_THREAD_POOL
                    and not any(spec.parameters.get(key) for key in _THREAD_PARAMETERS))
    if instances <= 1:
        return None
    return max(1, budget // instances)


def instance_options(spec: ModelSpec, threads: int | None = None,
                     caller: ModelCaller | None = None) -> list[EngineOptions]:
    """One EngineOptions per instance: ``count`` per listed GPU for KIND_GPU, ``count`` in total otherwise.
    CPU instances get ``threads`` intra-op threads unless the config sets its own; every instance gets ``caller``
    (the server, for models that call other models)."""
    own = any(spec.parameters.get(key) for key in _THREAD_PARAMETERS)
    cpu_threads = None if own else threads
    options = [each for group in spec.config.instance_group for each in instance_group_options(group, cpu_threads)]
    options = options or [EngineOptions(intra_op_threads=cpu_threads)]
    return [dataclasses.replace(each, caller=caller) for each in options]


def create_instances(spec: ModelSpec, model_file: Path, threads: int | None = None,
                     caller: ModelCaller | None = None) -> list[Engine]:
    engines: list[Engine] = []
    try:
        for options in instance_options(spec, threads, caller):
            engines.append(create_engine(spec, model_file, options))
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    return engines
