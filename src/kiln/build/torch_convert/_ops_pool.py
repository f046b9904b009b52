"""MaxPool, AveragePool, GlobalAveragePool and GlobalMaxPool."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kiln.build.torch_convert._node import Lowered, NodeUnsupportedError, NodeView, call
from kiln.build.torch_convert._window import Window, read_window

_MAX: dict[int, Callable[..., torch.Tensor]] = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG: dict[int, Callable[..., torch.Tensor]] = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def _lowest(dtype: torch.dtype) -> float | int:
    return torch.finfo(dtype).min if dtype.is_floating_point else torch.iinfo(dtype).min


def _max_pool(x: torch.Tensor, *, rank: int, kernel: tuple[int, ...], stride: tuple[int, ...],
              padding: tuple[int, ...], dilation: tuple[int, ...], ceil_mode: bool,
              pre_pad: tuple[int, ...] | None) -> torch.Tensor:
    if pre_pad is not None:  # pads torch cannot take: pad with the lowest value so it never wins
        x = F.pad(x, pre_pad, value=_lowest(x.dtype))
    return _MAX[rank](x, kernel, stride, padding, dilation, ceil_mode)


def _avg_pool(x: torch.Tensor, *, rank: int, kernel: tuple[int, ...], stride: tuple[int, ...],
              padding: tuple[int, ...], ceil_mode: bool, count_include_pad: bool,
              pre_pad: tuple[int, ...] | None) -> torch.Tensor:
    pool = _AVG[rank]
    if pre_pad is None:
        return pool(x, kernel, stride, padding, ceil_mode, count_include_pad)
    y = pool(F.pad(x, pre_pad), kernel, stride, 0, False, True)
    if count_include_pad:
        return y
    # Divide by the share of real (unpadded) pixels in each window instead.
    ones = F.pad(torch.ones_like(x[:1, :1]), pre_pad)
    return y / pool(ones, kernel, stride, 0, False, True)


def _global_avg(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(2, x.dim())), keepdim=True)


def _global_max(x: torch.Tensor) -> torch.Tensor:
    return x.amax(dim=tuple(range(2, x.dim())), keepdim=True)


def _pool_window(n: NodeView) -> tuple[Window, bool]:
    kernel = n.attr_ints("kernel_shape")
    if kernel is None or not 1 <= len(kernel) <= 3:
        raise NodeUnsupportedError(f"kernel_shape {kernel} must give 1, 2 or 3 spatial axes")
    return read_window(n, kernel), bool(n.attr_int("ceil_mode", 0))


def _native_or_pre_pad(win: Window, ceil_mode: bool, limits: tuple[int, ...]) -> tuple[tuple[int, ...],
                                                                                     tuple[int, ...] | None]:
    """torch pools pad both sides alike and at most ``limits``; other pads are applied beforehand."""
    rank = len(win.kernel)
    if win.symmetric and all(p <= lim for p, lim in zip(win.begin, limits, strict=True)):
        return win.begin, None
    if ceil_mode:
        raise NodeUnsupportedError(f"ceil_mode=1 with pads {list(win.begin + win.end)}: only symmetric pads of at "
                                   f"most half the kernel are supported with ceil_mode")
    return (0,) * rank, win.torch_pad()


def _max_pool_rule(n: NodeView) -> Lowered:
    n.outputs_used(1, "the Indices output")
    win, ceil_mode = _pool_window(n)
    limits = tuple(((k - 1) * d + 1) // 2 for k, d in zip(win.kernel, win.dilations, strict=True))
    padding, pre_pad = _native_or_pre_pad(win, ceil_mode, limits)
    return call(_max_pool, (n.input(0),), rank=len(win.kernel), kernel=win.kernel, stride=win.strides,
                padding=padding, dilation=win.dilations, ceil_mode=ceil_mode, pre_pad=pre_pad)


def _avg_pool_rule(n: NodeView) -> Lowered:
    win, ceil_mode = _pool_window(n)
    if any(d != 1 for d in win.dilations):
        raise NodeUnsupportedError(f"dilations {list(win.dilations)}: only 1 is supported for AveragePool")
    padding, pre_pad = _native_or_pre_pad(win, ceil_mode, tuple(k // 2 for k in win.kernel))
    return call(_avg_pool, (n.input(0),), rank=len(win.kernel), kernel=win.kernel, stride=win.strides,
                padding=padding, ceil_mode=ceil_mode, count_include_pad=bool(n.attr_int("count_include_pad", 0)),
                pre_pad=pre_pad)


RULES: dict[str, Callable[[NodeView], Lowered]] = {
    "MaxPool": _max_pool_rule,
    "AveragePool": _avg_pool_rule,
    "GlobalAveragePool": lambda n: call(_global_avg, (n.input(0),)),
    "GlobalMaxPool": lambda n: call(_global_max, (n.input(0),)),
}

__all__ = ["RULES"]
