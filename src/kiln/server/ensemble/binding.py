"""Check an ensemble's steps against the models they call: the step models exist and are ready, every mapped
name is a real input or output, and each tensor's datatype and shape agree between its producer and its readers."""

from __future__ import annotations

from collections.abc import Callable

from kiln.config.spec import ModelSpec, TensorSpec
from kiln.errors import ConfigError, KilnError, ModelNotReadyError
from kiln.server.ensemble.plan import EnsemblePlan
from kiln.tensor import DataType

# (model name, version or LATEST) -> the spec of the version a step would reach; raises KilnError when none is ready
SpecLookup = Callable[[str, int], ModelSpec]


class _Tensor:
    def __init__(self, datatype: DataType, shape: tuple[int, ...], origin: str) -> None:
        self.datatype, self.shape, self.origin = datatype, shape, origin


def bind_ensemble(plan: EnsemblePlan, spec: ModelSpec, lookup: SpecLookup) -> dict[int, ModelSpec]:
    """The spec each step reaches, by step index. Raises ModelNotReadyError when a step's model is not ready and
    ConfigError when the step and its model disagree."""
    where = f"ensemble '{spec.name}'"
    tensors = {t.name: _Tensor(t.datatype, spec.request_shape(t), f"ensemble input '{t.name}'")
               for t in spec.inputs}
    bound: dict[int, ModelSpec] = {}
    for index in plan.order:
        step = plan.steps[index]
        try:
            model = lookup(step.model_name, step.model_version)
        except KilnError as exc:
            raise ModelNotReadyError(f"{where}: {step.label} cannot run: {exc}") from None
        label = f"{where}: {step.label}"
        if spec.batching and (not model.batching or model.max_batch_size < spec.max_batch_size):
            raise ConfigError(f"{label}: the ensemble has max_batch_size {spec.max_batch_size} but the model's is "
                              f"{model.max_batch_size}; a composing model must batch at least as many rows")
        for model_input, tensor in step.inputs:
            target = model.input_map.get(model_input)
            if target is None:
                raise ConfigError(f"{label}: input_map names '{model_input}', which is not an input of the model; "
                                  f"its inputs are {', '.join(model.input_map)}")
            _check_edge(label, tensors[tensor], f"tensor '{tensor}' -> input '{model_input}'", target,
                        model.request_shape(target))
        mapped = {name for name, _ in step.inputs}
        missing = [t.name for t in model.inputs if t.name not in mapped and not t.optional]
        if missing:
            raise ConfigError(f"{label}: the model's input(s) {', '.join(missing)} are not in the step's input_map")
        for model_output, tensor in step.outputs:
            source = model.output_map.get(model_output)
            if source is None:
                raise ConfigError(f"{label}: output_map names '{model_output}', which is not an output of the "
                                  f"model; its outputs are {', '.join(model.output_map)}")
            tensors[tensor] = _Tensor(source.datatype, model.request_shape(source),
                                      f"{step.label} output '{model_output}'")
        bound[index] = model
    for output in spec.outputs:
        _check_edge(where, tensors[output.name], f"ensemble output '{output.name}'", output,
                    spec.request_shape(output))
    return bound


def _check_edge(label: str, produced: _Tensor, edge: str, target: TensorSpec, shape: tuple[int, ...]) -> None:
    if produced.datatype is not target.datatype:
        raise ConfigError(f"{label}: {edge}: {produced.origin} is {produced.datatype.wire_name} but "
                          f"{target.datatype.wire_name} is expected")
    if not _shapes_agree(produced.shape, shape):
        raise ConfigError(f"{label}: {edge}: {produced.origin} has shape {list(produced.shape)} but "
                          f"{list(shape)} is expected (-1: any size)")


def _shapes_agree(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b, strict=True))
