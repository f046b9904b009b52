"""An ensemble's steps as a validated graph: which ensemble tensor each step reads and writes, and in what order
steps can run. Everything here needs only the ensemble's own config; checks against the composing models' specs
live in binding.py."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.config.spec import ModelSpec
from kiln.errors import ConfigError
from kiln.v2._generated import model_config_pb2 as pb

LATEST = -1  # model_version -1 (or 0, the proto default) asks for the newest ready version


@dataclass(frozen=True)
class Step:
    index: int
    model_name: str
    model_version: int  # LATEST or a version number
    inputs: tuple[tuple[str, str], ...]  # (step model input, ensemble tensor)
    outputs: tuple[tuple[str, str], ...]  # (step model output, ensemble tensor)

    @property
    def label(self) -> str:
        return f"step {self.index} (model '{self.model_name}')"

    @property
    def version_text(self) -> str:
        return "" if self.model_version == LATEST else str(self.model_version)

    @property
    def reads(self) -> set[str]:
        return {tensor for _, tensor in self.inputs}


@dataclass(frozen=True)
class EnsemblePlan:
    name: str
    steps: tuple[Step, ...]
    producers: dict[str, int]  # ensemble tensor -> index of the step that writes it
    inputs: frozenset[str]  # the ensemble's own inputs
    order: tuple[int, ...]  # step indexes in an order where every step comes after its producers

    @property
    def model_names(self) -> set[str]:
        return {step.model_name for step in self.steps}

    def ready_steps(self, available: set[str], started: set[int]) -> list[Step]:
        """Steps not yet started whose every input tensor is available."""
        return [s for s in self.steps if s.index not in started and s.reads <= available]


def plan_ensemble(spec: ModelSpec, source: str) -> EnsemblePlan:
    """Check an ensemble's steps form a graph that can run: every tensor read is an ensemble input or written by
    exactly one step, every ensemble output is written, every input is read, and there is no cycle."""
    config = spec.config
    if config.WhichOneof("scheduling_choice") != "ensemble_scheduling" or not config.ensemble_scheduling.step:
        raise ConfigError(f"{source}: platform 'ensemble' needs ensemble_scheduling with at least one step "
                          f"(model_name, model_version, input_map, output_map)")
    steps = tuple(_step(index, raw, spec.name, source) for index, raw in enumerate(config.ensemble_scheduling.step))
    inputs = frozenset(t.name for t in spec.inputs)
    producers: dict[str, int] = {}
    for step in steps:
        for model_output, tensor in step.outputs:
            if tensor in inputs:
                raise ConfigError(f"{source}: {step.label} writes output '{model_output}' to '{tensor}', which is "
                                  f"an ensemble input; map it to a new tensor name")
            if tensor in producers:
                raise ConfigError(f"{source}: tensor '{tensor}' is written by step {producers[tensor]} and by "
                                  f"{step.label}; each ensemble tensor needs exactly one producer")
            producers[tensor] = step.index
    for step in steps:
        for model_input, tensor in step.inputs:
            if tensor not in inputs and tensor not in producers:
                raise ConfigError(f"{source}: {step.label} reads '{tensor}' for its input '{model_input}', but no "
                                  f"ensemble input or step output is named '{tensor}'")
    for output in spec.outputs:
        if output.name not in producers:
            raise ConfigError(f"{source}: ensemble output '{output.name}' is not written by any step; map a step "
                              f"output to it in an output_map")
    read = set().union(*(step.reads for step in steps))
    unused = sorted(inputs - read)
    if unused:
        raise ConfigError(f"{source}: ensemble input(s) {', '.join(unused)} are not read by any step")
    return EnsemblePlan(spec.name, steps, producers, inputs, _topological_order(steps, inputs, source))


def _step(index: int, raw: pb.ModelEnsembling.Step, ensemble: str, source: str) -> Step:
    where = f"{source}: ensemble_scheduling step {index}"
    if not raw.model_name:
        raise ConfigError(f"{where} has no model_name")
    if raw.model_name == ensemble:
        raise ConfigError(f"{where} calls the ensemble '{ensemble}' itself")
    if raw.model_version < LATEST:
        raise ConfigError(f"{where} (model '{raw.model_name}'): model_version {raw.model_version} is not valid; "
                          f"expected -1 (the newest ready version) or a version number")
    if not raw.input_map or not raw.output_map:
        raise ConfigError(f"{where} (model '{raw.model_name}') needs both an input_map and an output_map")
    version = LATEST if raw.model_version <= 0 else raw.model_version
    return Step(index, raw.model_name, version, tuple(sorted(raw.input_map.items())),
                tuple(sorted(raw.output_map.items())))


def _topological_order(steps: tuple[Step, ...], inputs: frozenset[str], source: str) -> tuple[int, ...]:
    available = set(inputs)
    order: list[int] = []
    while len(order) < len(steps):
        ready = [s for s in steps if s.index not in order and s.reads <= available]
        if not ready:
            stuck = [s.label for s in steps if s.index not in order]
            raise ConfigError(f"{source}: the ensemble steps form a cycle; these steps wait on each other's "
                              f"outputs: {', '.join(stuck)}")
        for step in ready:
            order.append(step.index)
            available.update(tensor for _, tensor in step.outputs)
    return tuple(order)
