"""What an operator rule sees of one ONNX node, and what it returns: a call, an alias or a constant."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import onnx
import torch
from onnx import TensorProto, helper

# ONNX element types kiln converts, with their torch dtypes (unsigned types above 8 bits have too few torch kernels).
TORCH_DTYPES: dict[int, torch.dtype] = {
    TensorProto.FLOAT: torch.float32,
    TensorProto.DOUBLE: torch.float64,
    TensorProto.FLOAT16: torch.float16,
    TensorProto.BFLOAT16: torch.bfloat16,
    TensorProto.INT8: torch.int8,
    TensorProto.UINT8: torch.uint8,
    TensorProto.INT16: torch.int16,
    TensorProto.INT32: torch.int32,
    TensorProto.INT64: torch.int64,
    TensorProto.BOOL: torch.bool,
}


class NodeUnsupportedError(Exception):
    """Raised by an operator rule: this node uses something the rule does not implement (the message says what)."""


@dataclass(frozen=True)
class Lowered:
    """How one node runs: ``fn(*inputs, **kwargs)``, the value of input ``alias``, or a ``constant``.

    ``inputs`` are node input names read at run time ('' passes None for an absent optional input). ``fn`` returns a
    tuple when ``outputs`` > 1.
    """

    fn: Callable[..., Any] | None = None
    inputs: tuple[str, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    outputs: int = 1
    alias: str | None = None
    constant: torch.Tensor | None = None


def call(fn: Callable[..., Any], inputs: tuple[str, ...], outputs: int = 1, **kwargs: Any) -> Lowered:
    return Lowered(fn=fn, inputs=inputs, kwargs=kwargs, outputs=outputs)


class Constants:
    """Tensors known at conversion time: initializers (read lazily), Constant outputs and folded results."""

    def __init__(self, initializers: Mapping[str, TensorProto]) -> None:
        self._protos = dict(initializers)
        self._tensors: dict[str, torch.Tensor] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._tensors or name in self._protos

    def add(self, name: str, value: torch.Tensor) -> None:
        self._tensors[name] = value

    def get(self, name: str) -> torch.Tensor:
        tensor = self._tensors.get(name)
        if tensor is None:
            tensor = tensor_from_proto(self._protos[name])
            self._tensors[name] = tensor
        return tensor

    def check(self, name: str) -> None:
        """Raise NodeUnsupportedError if ``name`` could not be read, without reading its data."""
        if name not in self._tensors:
            _check_proto(self._protos[name])


def _check_proto(proto: TensorProto) -> torch.dtype:
    dtype = TORCH_DTYPES.get(proto.data_type)
    if dtype is None:
        type_name = TensorProto.DataType.Name(proto.data_type)
        raise NodeUnsupportedError(f"tensor '{proto.name}' has element type {type_name}, which the converter "
                                   f"does not handle")
    if proto.data_location == TensorProto.EXTERNAL:
        raise NodeUnsupportedError(f"tensor '{proto.name}' keeps its data in an external file that was not "
                                   f"loaded; load the model with onnx.load(path) so external data is read")
    return dtype


def tensor_from_proto(proto: TensorProto) -> torch.Tensor:
    """A torch tensor holding a copy of an ONNX tensor (raises NodeUnsupportedError for types kiln leaves out)."""
    dtype = _check_proto(proto)
    array = onnx.numpy_helper.to_array(proto)
    if dtype is torch.bfloat16:  # numpy has no bfloat16; every bfloat16 value is exact in float32
        return torch.from_numpy(array.astype("float32")).to(torch.bfloat16)
    return torch.from_numpy(array.copy())


class NodeView:
    """One node with typed attribute access and conversion-time reads of constant inputs."""

    def __init__(self, node: onnx.NodeProto, since_version: int, constants: Constants) -> None:
        self.node = node
        self.since_version = since_version
        self._constants = constants
        self._attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}

    @property
    def op_type(self) -> str:
        return str(self.node.op_type)

    def input(self, index: int) -> str:
        """The name of input ``index``, or '' when the node leaves it out."""
        return str(self.node.input[index]) if index < len(self.node.input) else ""

    def has_attr(self, name: str) -> bool:
        return name in self._attrs

    def attr_int(self, name: str, default: int) -> int:
        value = self._attrs.get(name, default)
        if not isinstance(value, int):
            raise NodeUnsupportedError(f"attribute {name} must be an int, got {value!r}")
        return value

    def attr_float(self, name: str, default: float) -> float:
        value = self._attrs.get(name, default)
        if not isinstance(value, (int, float)):
            raise NodeUnsupportedError(f"attribute {name} must be a float, got {value!r}")
        return float(value)

    def attr_str(self, name: str, default: str) -> str:
        value = self._attrs.get(name, default)
        return value.decode() if isinstance(value, bytes) else str(value)

    def attr_ints(self, name: str) -> tuple[int, ...] | None:
        value = self._attrs.get(name)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
            raise NodeUnsupportedError(f"attribute {name} must be a list of ints, got {value!r}")
        return tuple(value)

    def attr(self, name: str) -> Any:
        return self._attrs.get(name)

    def is_constant(self, index: int) -> bool:
        return self.input(index) in self._constants

    def constant(self, index: int, what: str) -> torch.Tensor:
        """The value of input ``index``, which must be known at conversion time."""
        name = self.input(index)
        if name not in self._constants:
            raise NodeUnsupportedError(f"{what} (input '{name}') must be a constant initializer or Constant output; "
                                       f"it is computed at run time")
        return self._constants.get(name)

    def constant_ints(self, index: int, what: str) -> tuple[int, ...]:
        tensor = self.constant(index, what)
        if tensor.is_floating_point() or tensor.dtype is torch.bool or tensor.dim() > 1:
            raise NodeUnsupportedError(f"{what} (input '{self.input(index)}') must be a 1-D integer tensor, got "
                                       f"{tensor.dtype} with shape {list(tensor.shape)}")
        return tuple(int(v) for v in tensor.reshape(-1).tolist())

    def constant_scalar(self, index: int, what: str) -> float | int | bool | None:
        """A one-element constant input as a Python number; None when the input is left out."""
        if not self.input(index):
            return None
        tensor = self.constant(index, what)
        if tensor.numel() != 1:
            raise NodeUnsupportedError(f"{what} (input '{self.input(index)}') must hold one value, got shape "
                                       f"{list(tensor.shape)}")
        value: float | int | bool = tensor.reshape(-1)[0].item()
        return value

    def outputs_used(self, count: int, what: str) -> None:
        """Refuse a node that asks for outputs past the first ``count`` (optional outputs the rule leaves out)."""
        extra = [name for name in self.node.output[count:] if name]
        if extra:
            raise NodeUnsupportedError(f"{what} (output '{extra[0]}') is not supported")


__all__ = ["TORCH_DTYPES", "Constants", "Lowered", "NodeUnsupportedError", "NodeView", "call", "tensor_from_proto"]
