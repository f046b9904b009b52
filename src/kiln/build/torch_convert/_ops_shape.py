"""Layout operators: Flatten, Reshape, Transpose, Concat, Split, Squeeze, Unsqueeze, Slice and Pad.

Shapes, axes, pads and slice bounds are read at conversion time, so the converted graph has no branch on tensor
values; only the input's rank and sizes (static under tracing, symbolic under torch.export) are used at run time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kiln.build.torch_convert._node import Lowered, NodeUnsupportedError, NodeView, call

# Slice bounds at or past these mean "to the end" / "from the start" (exporters write INT_MAX / INT_MIN).
_TO_END = 2**31 - 1
_FROM_START = -(2**31)


def _flatten(x: torch.Tensor, *, axis: int) -> torch.Tensor:
    axis = axis + x.dim() if axis < 0 else axis
    if axis == 0:
        return x.flatten().unsqueeze(0)
    if axis == x.dim():
        return x.flatten().unsqueeze(1)
    return x.flatten(axis).flatten(0, axis - 1)


def _reshape(x: torch.Tensor, *, shape: tuple[int, ...], allowzero: bool) -> torch.Tensor:
    # A 0 copies the input's size on that axis unless allowzero asks for a real zero.
    return x.reshape([x.shape[i] if s == 0 and not allowzero else s for i, s in enumerate(shape)])


def _transpose(x: torch.Tensor, *, perm: tuple[int, ...] | None) -> torch.Tensor:
    return x.permute(perm if perm is not None else tuple(reversed(range(x.dim()))))


def _concat(*xs: torch.Tensor, axis: int) -> torch.Tensor:
    return torch.cat(xs, dim=axis)


def _split(x: torch.Tensor, *, sizes: tuple[int, ...] | None, parts: int, axis: int) -> tuple[torch.Tensor, ...]:
    if sizes is not None:
        return tuple(torch.split(x, list(sizes), dim=axis))
    return tuple(torch.chunk(x, parts, dim=axis))  # parts of ceil(size / parts), the last one smaller


def _squeeze(x: torch.Tensor, *, axes: tuple[int, ...] | None) -> torch.Tensor:
    return x.squeeze() if axes is None else x.squeeze(axes)


def _unsqueeze(x: torch.Tensor, *, axes: tuple[int, ...]) -> torch.Tensor:
    rank = x.dim() + len(axes)  # axes index the output
    for axis in sorted(a % rank for a in axes):
        x = x.unsqueeze(axis)
    return x


def _slice(x: torch.Tensor, *, index: tuple[slice, ...], flips: tuple[int, ...]) -> torch.Tensor:
    return (x.flip(flips) if flips else x)[index]


def _slice_index(starts: tuple[int, ...], ends: tuple[int, ...], axes: tuple[int, ...],
                 steps: tuple[int, ...]) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    """Python slices (over axes 0..max(axes)) and the axes to flip first, for non-negative ``axes``.

    torch has no negative steps, so a backward slice walks the flipped axis forward: element i is at flipped
    position size-1-i, which Python's negative indices express without knowing the size.
    """
    index = [slice(None)] * (max(axes) + 1)
    flips = []
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        if step > 0:
            index[axis] = slice(None if start <= _FROM_START else start, None if end >= _TO_END else end, step)
            continue
        first = None if start >= _TO_END else (-1 - start if start < 0 else -(start + 1))
        stop = None if end <= _FROM_START else (-1 - end if end < 0 else -(end + 1))
        index[axis] = slice(first, stop, -step)
        flips.append(axis)
    return tuple(index), tuple(flips)


def _pad(x: torch.Tensor, *, pads: tuple[int, ...], value: float | int | bool | None,
         axes: tuple[int, ...] | None) -> torch.Tensor:
    rank = x.dim()
    axes_list = list(range(rank)) if axes is None else [a % rank for a in axes]
    count = len(axes_list)
    begin = dict(zip(axes_list, pads[:count], strict=True))
    end = dict(zip(axes_list, pads[count:], strict=True))
    # F.pad lists (begin, end) from the last axis back; negative amounts crop, as ONNX defines them.
    flat = [v for axis in reversed(range(rank)) for v in (begin.get(axis, 0), end.get(axis, 0))]
    return F.pad(x, flat, value=0 if value is None else value)


def _axes(n: NodeView, index: int, attr_until: int) -> tuple[int, ...] | None:
    """Axes from the attribute (opsets before ``attr_until``) or from a constant input; None when absent."""
    if n.since_version < attr_until:
        return n.attr_ints("axes")
    return n.constant_ints(index, "axes") if n.input(index) else None


def _reshape_rule(n: NodeView) -> Lowered:
    shape = n.constant_ints(1, "the shape")
    allowzero = bool(n.attr_int("allowzero", 0))
    return call(_reshape, (n.input(0),), shape=shape, allowzero=allowzero)


def _split_rule(n: NodeView) -> Lowered:
    count = len(n.node.output)
    axis = n.attr_int("axis", 0)
    sizes = n.attr_ints("split") if n.since_version < 13 else (
        n.constant_ints(1, "split") if n.input(1) else None)
    parts = n.attr_int("num_outputs", count) if n.since_version >= 18 else count
    if sizes is not None and len(sizes) != count:
        raise NodeUnsupportedError(f"split has {len(sizes)} sizes for {count} outputs")
    return call(_split, (n.input(0),), outputs=count, sizes=sizes, parts=parts, axis=axis)


def _unsqueeze_rule(n: NodeView) -> Lowered:
    axes = _axes(n, 1, 13)
    if axes is None:
        raise NodeUnsupportedError("Unsqueeze needs axes")
    return call(_unsqueeze, (n.input(0),), axes=axes)


def _slice_rule(n: NodeView) -> Lowered:
    starts = n.constant_ints(1, "starts")
    ends = n.constant_ints(2, "ends")
    axes = n.constant_ints(3, "axes") if n.input(3) else tuple(range(len(starts)))
    steps = n.constant_ints(4, "steps") if n.input(4) else (1,) * len(starts)
    if not starts or any(len(v) != len(starts) for v in (ends, axes, steps)):
        raise NodeUnsupportedError("starts, ends, axes and steps must be non-empty and of the same length")
    if 0 in steps:
        raise NodeUnsupportedError("a step of 0 is not allowed")
    if min(axes) < 0:
        if max(axes) >= 0:
            raise NodeUnsupportedError(f"axes {list(axes)} mix negative and non-negative values; the rank is "
                                       f"unknown at conversion time")
        # Count from the back: slice over the trailing axes behind an Ellipsis.
        index, flips = _slice_index(starts, ends, tuple(-1 - a for a in axes), steps)
        return call(_slice, (n.input(0),), index=(..., *reversed(index)), flips=tuple(-1 - a for a in flips))
    index, flips = _slice_index(starts, ends, axes, steps)
    return call(_slice, (n.input(0),), index=index, flips=flips)


def _pad_rule(n: NodeView) -> Lowered:
    mode = n.attr_str("mode", "constant")
    if mode != "constant":
        raise NodeUnsupportedError(f"mode='{mode}' is not supported (only 'constant')")
    pads = n.constant_ints(1, "pads")
    value = n.constant_scalar(2, "constant_value")
    axes = n.constant_ints(3, "axes") if n.input(3) else None
    return call(_pad, (n.input(0),), pads=pads, value=value, axes=axes)


RULES: dict[str, Callable[[NodeView], Lowered]] = {
    "Flatten": lambda n: call(_flatten, (n.input(0),), axis=n.attr_int("axis", 1)),
    "Reshape": _reshape_rule,
    "Transpose": lambda n: call(_transpose, (n.input(0),), perm=n.attr_ints("perm")),
    "Concat": lambda n: call(_concat, tuple(n.node.input), axis=n.attr_int("axis", 0)),
    "Split": _split_rule,
    "Squeeze": lambda n: call(_squeeze, (n.input(0),), axes=_axes(n, 1, 13)),
    "Unsqueeze": _unsqueeze_rule,
    "Slice": _slice_rule,
    "Pad": _pad_rule,
}

__all__ = ["RULES"]
