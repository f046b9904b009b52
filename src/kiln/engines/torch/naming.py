"""Which config tensor is which model argument or result: the conventions of Triton's PyTorch backend.

Inputs, in this order of preference:

1. every input name is an argument name of ``forward()``: each goes to that argument's position;
2. every input name is ``<name>__<index>``: each goes to position ``<index>``;
3. otherwise the config's order is the argument order.

Outputs: a model that returns a dict is matched by key (kiln's addition); for a tensor, tuple or list, every output
named ``<name>__<index>`` takes element ``<index>``, otherwise the config's order is the result order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kiln.config.spec import ModelSpec
from kiln.engines.torch.loading import LoadedModel
from kiln.errors import ConfigError, InternalError


def index_suffix(name: str) -> int | None:
    """``3`` for ``"INPUT__3"``; None when the part after the first ``__`` is not a plain number."""
    _, separator, tail = name.partition("__")
    return int(tail) if separator and tail.isascii() and tail.isdigit() else None


def input_positions(spec: ModelSpec, model: LoadedModel) -> dict[str, int]:
    """The argument position of each config input; ConfigError when they do not fit the model's forward()."""
    names = [tensor.name for tensor in spec.inputs]
    if model.arg_names is not None and all(name in model.arg_names for name in names):
        positions = {name: model.arg_names.index(name) for name in names}
    elif names and all(index_suffix(name) is not None for name in names):
        positions = {name: index_suffix(name) or 0 for name in names}
    else:
        positions = {name: index for index, name in enumerate(names)}
    if sorted(positions.values()) != list(range(len(names))):
        listed = ", ".join(f"{name} -> {position}" for name, position in positions.items())
        raise ConfigError(f"model '{spec.name}': the inputs map to argument positions {listed}; positions must be "
                          f"0..{len(names) - 1} with none repeated (name inputs <name>__<index> or after forward()'s "
                          f"arguments)")
    if model.required_args is not None and model.arg_names is not None:
        if not model.required_args <= len(names) <= len(model.arg_names):
            raise ConfigError(f"model '{spec.name}': forward() takes {len(model.arg_names)} tensor arguments "
                              f"({', '.join(model.arg_names)}; {model.required_args} required), but the config "
                              f"declares {len(names)} inputs")
    elif model.required_args is not None and len(names) != model.required_args:
        raise ConfigError(f"model '{spec.name}': the model takes {model.required_args} inputs, but the config "
                          f"declares {len(names)}")
    return positions


def output_positions(spec: ModelSpec) -> dict[str, int]:
    """Where each config output sits in a tuple or list result."""
    names = [tensor.name for tensor in spec.outputs]
    if all(index_suffix(name) is not None for name in names):
        return {name: index_suffix(name) or 0 for name in names}
    return {name: index for index, name in enumerate(names)}


def select_outputs(spec: ModelSpec, result: object, positions: Mapping[str, int],
                   wanted: Sequence[str]) -> dict[str, object]:
    """Pick the wanted outputs from what forward() returned."""
    if isinstance(result, Mapping):
        missing = [name for name in wanted if name not in result]
        if missing:
            keys = ", ".join(str(key) for key in result) or "none"
            raise InternalError(f"model '{spec.name}': the model returned a dict without key '{missing[0]}' "
                                f"(its keys: {keys}); dict results are matched to outputs by name")
        return {name: result[name] for name in wanted}
    items = (result,) if isinstance(result, torch.Tensor) else result
    if not isinstance(items, (tuple, list)):
        raise InternalError(f"model '{spec.name}': the model returned a {type(result).__name__}; expected a "
                            f"tensor, a tuple or list of tensors, or a dict of tensors")
    selected: dict[str, object] = {}
    for name in wanted:
        position = positions[name]
        if position >= len(items):
            raise InternalError(f"model '{spec.name}': output '{name}' is result {position}, but the model "
                                f"returned {len(items)} value(s)")
        selected[name] = items[position]
    return selected
