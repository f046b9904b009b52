"""Create a model version's engine instances from its instance groups."""

from __future__ import annotations

from pathlib import Path

from kiln.config._generated import model_config_pb2 as pb
from kiln.config.spec import ModelSpec
from kiln.engines.base import Engine, EngineOptions, create_engine


def instance_options(spec: ModelSpec) -> list[EngineOptions]:
    """One EngineOptions per instance: ``count`` per listed GPU for KIND_GPU, ``count`` in total otherwise."""
    options: list[EngineOptions] = []
    for group in spec.config.instance_group:
        if group.kind == pb.ModelInstanceGroup.KIND_GPU:
            for gpu in list(group.gpus) or [0]:
                options.extend(EngineOptions(kind="gpu", device_id=gpu) for _ in range(group.count))
        else:
            options.extend(EngineOptions(kind="cpu") for _ in range(group.count))
    return options or [EngineOptions()]


def create_instances(spec: ModelSpec, model_file: Path) -> list[Engine]:
    engines: list[Engine] = []
    try:
        for options in instance_options(spec):
            engines.append(create_engine(spec, model_file, options))
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    return engines
