"""Element-wise operators, activations, Softmax, Cast and the pass-through nodes (Identity, Dropout, Constant)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from onnx import TensorProto

from kiln.build.torch_convert._node import (
    TORCH_DTYPES,
    Lowered,
    NodeUnsupportedError,
    NodeView,
    call,
    tensor_from_proto,
)

Rule = Callable[[NodeView], Lowered]


def _div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.is_floating_point() or b.is_floating_point():
        return torch.div(a, b)
    return torch.div(a, b, rounding_mode="trunc")  # ONNX integer Div truncates toward zero, as C does


def _pow(base: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    return torch.pow(base, exponent).to(base.dtype)  # the result keeps the base's type


def _hard_sigmoid(x: torch.Tensor, *, alpha: float, beta: float) -> torch.Tensor:
    return torch.clamp(x * alpha + beta, 0.0, 1.0)


def _clip(x: torch.Tensor, *, low: float | int | None, high: float | int | None) -> torch.Tensor:
    if low is None and high is None:
        return x
    return torch.clamp(x, min=low, max=high)


def _softmax(x: torch.Tensor, *, axis: int, log: bool) -> torch.Tensor:
    return F.log_softmax(x, dim=axis) if log else F.softmax(x, dim=axis)


def _softmax_flat(x: torch.Tensor, *, axis: int, log: bool) -> torch.Tensor:
    # Opset < 13: the input is seen as 2-D [prod(dims before axis), prod(dims from axis)] and normalized per row.
    axis = axis % x.dim()
    rows = x.flatten(axis) if axis > 0 else x.reshape(-1)
    return _softmax(rows, axis=-1, log=log).reshape(x.shape)


def _cast(x: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype)


def _unary(fn: Callable[..., Any]) -> Rule:
    return lambda n: call(fn, (n.input(0),))


def _binary(fn: Callable[..., Any]) -> Rule:
    return lambda n: call(fn, (n.input(0), n.input(1)))


def _leaky_relu(n: NodeView) -> Lowered:
    return call(F.leaky_relu, (n.input(0),), negative_slope=n.attr_float("alpha", 0.01))


def _hard_sigmoid_rule(n: NodeView) -> Lowered:
    return call(_hard_sigmoid, (n.input(0),), alpha=n.attr_float("alpha", 0.2), beta=n.attr_float("beta", 0.5))


def _gelu(n: NodeView) -> Lowered:
    approximate = n.attr_str("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise NodeUnsupportedError(f"approximate='{approximate}' is not one of 'none', 'tanh'")
    return call(F.gelu, (n.input(0),), approximate=approximate)


def _clip_rule(n: NodeView) -> Lowered:
    low = n.constant_scalar(1, "min")
    high = n.constant_scalar(2, "max")
    return call(_clip, (n.input(0),), low=low, high=high)


def _softmax_rule(log: bool) -> Rule:
    def rule(n: NodeView) -> Lowered:
        if n.since_version < 13:
            return call(_softmax_flat, (n.input(0),), axis=n.attr_int("axis", 1), log=log)
        return call(_softmax, (n.input(0),), axis=n.attr_int("axis", -1), log=log)

    return rule


def _cast_rule(n: NodeView) -> Lowered:
    to = n.attr_int("to", 0)
    dtype = TORCH_DTYPES.get(to)
    if dtype is None:
        name = TensorProto.DataType.Name(to) if to in TensorProto.DataType.values() else str(to)
        raise NodeUnsupportedError(f"Cast to {name} is not supported (supported: "
                                   f"{', '.join(TensorProto.DataType.Name(t) for t in TORCH_DTYPES)})")
    return call(_cast, (n.input(0),), dtype=dtype)


def _identity(n: NodeView) -> Lowered:
    return Lowered(alias=n.input(0))


def _dropout(n: NodeView) -> Lowered:
    n.outputs_used(1, "the mask output")
    if n.input(2):
        training = n.constant_scalar(2, "training_mode")
        if training:
            raise NodeUnsupportedError("training_mode is true; only inference (training_mode false) is supported")
    return Lowered(alias=n.input(0))


def _constant(n: NodeView) -> Lowered:
    value = n.attr("value")
    if value is not None:
        return Lowered(constant=tensor_from_proto(value))
    arrays: dict[str, Any] = {
        "value_float": np.float32, "value_floats": np.float32, "value_int": np.int64, "value_ints": np.int64,
    }
    for name, dtype in arrays.items():
        if n.has_attr(name):
            return Lowered(constant=torch.from_numpy(np.array(n.attr(name), dtype=dtype)))
    kinds = ", ".join(a.name for a in n.node.attribute) or "no value attribute"
    raise NodeUnsupportedError(f"Constant with {kinds} is not supported (value, value_float(s), value_int(s) are)")


RULES: dict[str, Rule] = {
    "Add": _binary(torch.add),
    "Sub": _binary(torch.sub),
    "Mul": _binary(torch.mul),
    "Div": _binary(_div),
    "Pow": _binary(_pow),
    "Sqrt": _unary(torch.sqrt),
    "Exp": _unary(torch.exp),
    "Log": _unary(torch.log),
    "Neg": _unary(torch.neg),
    "Abs": _unary(torch.abs),
    "Relu": _unary(torch.relu),
    "Sigmoid": _unary(torch.sigmoid),
    "Tanh": _unary(torch.tanh),
    "Erf": _unary(torch.erf),
    "HardSwish": _unary(F.hardswish),
    "LeakyRelu": _leaky_relu,
    "HardSigmoid": _hard_sigmoid_rule,
    "Gelu": _gelu,
    "Clip": _clip_rule,
    "Softmax": _softmax_rule(log=False),
    "LogSoftmax": _softmax_rule(log=True),
    "Cast": _cast_rule,
    "Identity": _identity,
    "Dropout": _dropout,
    "Constant": _constant,
}

__all__ = ["RULES", "Rule"]
