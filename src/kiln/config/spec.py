"""The validated, frozen view of a model configuration that the rest of kiln works with."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

from kiln.errors import InvalidArgumentError
from kiln.tensor import DataType
from kiln.v2._generated import model_config_pb2 as pb


@dataclass(frozen=True)
class TensorSpec:
    """One input or output as a request sees it: ``dims`` exclude the batch dimension; -1 means any size."""

    name: str
    datatype: DataType
    dims: tuple[int, ...]
    reshape: tuple[int, ...] | None = None
    optional: bool = False
    allow_ragged_batch: bool = False
    label_filename: str = ""

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "datatype": self.datatype.wire_name, "shape": list(self.dims)}


@dataclass(frozen=True)
class ModelSpec:
    """A model's validated configuration. ``config`` is the complete (auto-completed) ModelConfig; treat it as
    read-only."""

    name: str
    backend: str
    platform: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    config: pb.ModelConfig = field(compare=False, repr=False)
    parameters: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def batching(self) -> bool:
        return self.max_batch_size > 0

    # Lookups the request path needs on every request, computed once per spec.
    @functools.cached_property
    def input_map(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.inputs}

    @functools.cached_property
    def output_map(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.outputs}

    @functools.cached_property
    def request_shapes(self) -> dict[str, tuple[int, ...]]:
        return {t.name: self.request_shape(t) for t in self.inputs}

    def request_shape(self, tensor: TensorSpec) -> tuple[int, ...]:
        """The full shape a request carries for ``tensor``: the batch dimension (-1) first when batching."""
        return ((-1,) + tensor.dims) if self.batching else tensor.dims

    def input(self, name: str) -> TensorSpec:
        tensor = self.input_map.get(name)
        if tensor is not None:
            return tensor
        expected = ", ".join(t.name for t in self.inputs)
        raise InvalidArgumentError(f"model '{self.name}' has no input '{name}'; expected one of: {expected}")

    def output(self, name: str) -> TensorSpec:
        tensor = self.output_map.get(name)
        if tensor is not None:
            return tensor
        expected = ", ".join(t.name for t in self.outputs)
        raise InvalidArgumentError(f"model '{self.name}' has no output '{name}'; expected one of: {expected}")
