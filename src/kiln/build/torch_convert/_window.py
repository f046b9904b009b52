"""Kernel windows shared by Conv, ConvTranspose and the pools: strides, dilations and begin/end padding."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.build.torch_convert._node import NodeUnsupportedError, NodeView


@dataclass(frozen=True)
class Window:
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    begin: tuple[int, ...]
    end: tuple[int, ...]

    @property
    def symmetric(self) -> bool:
        return self.begin == self.end

    def torch_pad(self) -> tuple[int, ...]:
        """The padding as F.pad wants it: (begin, end) pairs from the last spatial axis to the first."""
        return tuple(v for i in reversed(range(len(self.begin))) for v in (self.begin[i], self.end[i]))


def spatial_ints(n: NodeView, name: str, rank: int, default: int) -> tuple[int, ...]:
    values = n.attr_ints(name)
    if values is None:
        return (default,) * rank
    if len(values) != rank:
        raise NodeUnsupportedError(f"attribute {name} has {len(values)} values; the kernel has {rank} spatial axes")
    return values


def read_window(n: NodeView, kernel: tuple[int, ...], same_ok: bool = True) -> Window:
    """Read strides, dilations and pads (auto_pad NOTSET and VALID; SAME_* where it does not depend on input size)."""
    rank = len(kernel)
    strides = spatial_ints(n, "strides", rank, 1)
    dilations = spatial_ints(n, "dilations", rank, 1)
    auto_pad = n.attr_str("auto_pad", "NOTSET")
    if auto_pad == "NOTSET":
        pads = n.attr_ints("pads") or (0,) * (2 * rank)
        if len(pads) != 2 * rank or min(pads) < 0:
            raise NodeUnsupportedError(f"pads {list(pads)} must be {2 * rank} values >= 0 (begin..., end...)")
        return Window(kernel, strides, dilations, pads[:rank], pads[rank:])
    if auto_pad == "VALID":
        return Window(kernel, strides, dilations, (0,) * rank, (0,) * rank)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER") and same_ok:
        if any(s != 1 for s in strides):
            raise NodeUnsupportedError(f"auto_pad={auto_pad} with strides {list(strides)}: the padding depends on "
                                       f"the input size; only strides of 1 are supported with SAME padding")
        totals = [d * (k - 1) for k, d in zip(kernel, dilations, strict=True)]
        small = tuple(t // 2 for t in totals)
        large = tuple(t - t // 2 for t in totals)
        # SAME_UPPER puts the odd pixel at the end, SAME_LOWER at the beginning.
        begin, end = (small, large) if auto_pad == "SAME_UPPER" else (large, small)
        return Window(kernel, strides, dilations, begin, end)
    same = ", SAME_UPPER, SAME_LOWER with strides 1" if same_ok else ""
    raise NodeUnsupportedError(f"auto_pad={auto_pad} is not supported for {n.op_type} (supported: NOTSET, VALID{same})")


__all__ = ["Window", "read_window", "spatial_ints"]
