"""ReduceMean, ReduceSum and ReduceMax (axes from the attribute or from a constant input, by opset)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.build.torch_convert._node import Lowered, NodeView, call

# The opset from which each reduction reads its axes from the second input instead of the attribute.
_AXES_INPUT_SINCE = {"ReduceSum": 13, "ReduceMean": 18, "ReduceMax": 18}


def _reduce(x: torch.Tensor, *, op: str, axes: tuple[int, ...], keepdims: bool, noop: bool) -> torch.Tensor:
    if not axes and noop:
        return x
    dims = axes or tuple(range(x.dim()))
    if op == "sum":
        return torch.sum(x, dim=dims, keepdim=keepdims, dtype=x.dtype)  # torch would widen integers to int64
    if op == "max":
        return torch.amax(x, dim=dims, keepdim=keepdims)
    if x.is_floating_point():
        return torch.mean(x, dim=dims, keepdim=keepdims)
    count = 1
    for d in dims:
        count *= x.shape[d]
    return torch.div(torch.sum(x, dim=dims, keepdim=keepdims, dtype=x.dtype), count, rounding_mode="trunc")


def _rule(op_type: str, op: str) -> Callable[[NodeView], Lowered]:
    def rule(n: NodeView) -> Lowered:
        if n.since_version < _AXES_INPUT_SINCE[op_type]:
            axes, noop = n.attr_ints("axes") or (), False
        else:
            axes = n.constant_ints(1, "axes") if n.input(1) else ()
            noop = bool(n.attr_int("noop_with_empty_axes", 0))
        return call(_reduce, (n.input(0),), op=op, axes=axes, keepdims=bool(n.attr_int("keepdims", 1)), noop=noop)

    return rule


RULES: dict[str, Callable[[NodeView], Lowered]] = {
    "ReduceMean": _rule("ReduceMean", "mean"),
    "ReduceSum": _rule("ReduceSum", "sum"),
    "ReduceMax": _rule("ReduceMax", "max"),
}

__all__ = ["RULES"]
