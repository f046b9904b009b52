"""Conv, ConvTranspose, Gemm, MatMul and the inference normalizations (BatchNormalization, LayerNormalization)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kiln.build.torch_convert._node import Lowered, NodeUnsupportedError, NodeView, call
from kiln.build.torch_convert._window import read_window, spatial_ints

_CONV: dict[int, Callable[..., torch.Tensor]] = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T: dict[int, Callable[..., torch.Tensor]] = {
    1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d,
}


def _conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, *, rank: int, stride: tuple[int, ...],
          padding: tuple[int, ...], dilation: tuple[int, ...], groups: int,
          pre_pad: tuple[int, ...] | None) -> torch.Tensor:
    if pre_pad is not None:  # asymmetric pads: torch's conv pads both sides alike
        x = F.pad(x, pre_pad)
    return _CONV[rank](x, w, b, stride, padding, dilation, groups)


def _conv_transpose(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, *, rank: int,
                    stride: tuple[int, ...], padding: tuple[int, ...], output_padding: tuple[int, ...],
                    dilation: tuple[int, ...], groups: int, crop: tuple[int, ...] | None) -> torch.Tensor:
    if crop is None:
        return _CONV_T[rank](x, w, b, stride, padding, output_padding, groups, dilation)
    # Full-size result, then one F.pad whose negative amounts crop the begin pads and whose end amounts add
    # output_padding minus the end pads (zeros past the full result, as ONNX defines them).
    y = F.pad(_CONV_T[rank](x, w, None, stride, 0, 0, groups, dilation), crop)
    return y if b is None else y + b.reshape(1, -1, *([1] * rank))


def _gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None, *, alpha: float, beta: float,
          trans_a: bool, trans_b: bool, fused: bool) -> torch.Tensor:
    if trans_a:
        a = a.t()
    if fused:  # alpha = beta = 1, B is [N, K] and C is [N]: one addmm
        return F.linear(a, b, c)
    y = F.linear(a, b) if trans_b else torch.matmul(a, b)
    if alpha != 1.0:
        y = y * alpha
    if c is not None:
        y = y + (c if beta == 1.0 else c * beta)
    return y


def _batch_norm(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor, var: torch.Tensor,
                *, eps: float) -> torch.Tensor:
    return F.batch_norm(x, mean, var, scale, bias, training=False, momentum=0.0, eps=eps)


def _layer_norm(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, *, axis: int, eps: float,
                normalized_shape: tuple[int, ...] | None) -> torch.Tensor:
    if normalized_shape is not None:  # Scale and B have exactly the normalized shape
        return F.layer_norm(x, normalized_shape, scale, bias, eps)
    y = F.layer_norm(x, x.shape[axis % x.dim():], eps=eps) * scale  # Scale and B broadcast
    return y if bias is None else y + bias


def _kernel(n: NodeView) -> tuple[int, ...]:
    """The kernel's spatial size: from kernel_shape, else from a constant weight."""
    kernel = n.attr_ints("kernel_shape")
    if kernel is None:
        if not n.is_constant(1):
            raise NodeUnsupportedError("the weight is computed at run time and kernel_shape is absent, so the "
                                       "spatial rank is unknown at conversion time")
        kernel = tuple(n.constant(1, "W").shape[2:])
    if not 1 <= len(kernel) <= 3:
        raise NodeUnsupportedError(f"{len(kernel)} spatial axes; 1, 2 or 3 are supported")
    return kernel


def _conv_rule(n: NodeView) -> Lowered:
    kernel = _kernel(n)
    win = read_window(n, kernel)
    rank = len(kernel)
    padding, pre_pad = (win.begin, None) if win.symmetric else ((0,) * rank, win.torch_pad())
    return call(_conv, (n.input(0), n.input(1), n.input(2)), rank=rank, stride=win.strides, padding=padding,
                dilation=win.dilations, groups=n.attr_int("group", 1), pre_pad=pre_pad)


def _conv_transpose_rule(n: NodeView) -> Lowered:
    if n.has_attr("output_shape"):
        raise NodeUnsupportedError("the output_shape attribute makes the pads depend on the input size; give pads")
    kernel = _kernel(n)
    win = read_window(n, kernel, same_ok=False)
    rank = len(kernel)
    out_pad = spatial_ints(n, "output_padding", rank, 0)
    native = win.symmetric and all(p < max(s, d) for p, s, d in zip(out_pad, win.strides, win.dilations, strict=True))
    crop = None if native else tuple(v for i in reversed(range(rank)) for v in (-win.begin[i], out_pad[i] - win.end[i]))
    return call(_conv_transpose, (n.input(0), n.input(1), n.input(2)), rank=rank, stride=win.strides,
                padding=win.begin if native else (0,) * rank, output_padding=out_pad if native else (0,) * rank,
                dilation=win.dilations, groups=n.attr_int("group", 1), crop=crop)


def _gemm_rule(n: NodeView) -> Lowered:
    alpha, beta = n.attr_float("alpha", 1.0), n.attr_float("beta", 1.0)
    trans_b = bool(n.attr_int("transB", 0))
    fused = False
    if trans_b and alpha == 1.0 and beta == 1.0 and n.is_constant(1) and n.is_constant(2):
        weight, bias = n.constant(1, "B"), n.constant(2, "C")
        fused = weight.dim() == 2 and bias.dim() == 1 and bias.shape[0] == weight.shape[0]
    return call(_gemm, (n.input(0), n.input(1), n.input(2)), alpha=alpha, beta=beta,
                trans_a=bool(n.attr_int("transA", 0)), trans_b=trans_b, fused=fused)


def _batch_norm_rule(n: NodeView) -> Lowered:
    if n.attr_int("training_mode", 0):
        raise NodeUnsupportedError("training_mode=1; only inference (training_mode=0) is supported")
    n.outputs_used(1, "the running mean/var outputs (training mode)")
    return call(_batch_norm, tuple(n.input(i) for i in range(5)), eps=n.attr_float("epsilon", 1e-5))


def _layer_norm_rule(n: NodeView) -> Lowered:
    if n.attr_int("stash_type", 1) != 1:
        raise NodeUnsupportedError("stash_type other than 1 (float32 statistics) is not supported")
    n.outputs_used(1, "the Mean/InvStdDev outputs")
    axis = n.attr_int("axis", -1)
    return call(_layer_norm, (n.input(0), n.input(1), n.input(2)), axis=axis, eps=n.attr_float("epsilon", 1e-5),
                normalized_shape=_exact_norm_shape(n, axis))


def _exact_norm_shape(n: NodeView, axis: int) -> tuple[int, ...] | None:
    """The normalized shape when constant Scale (and B) surely have it: as many axes as a negative ``axis``
    counts and no size-1 axis that might be a broadcast; None otherwise (the general path broadcasts)."""
    if axis >= 0 or not n.is_constant(1) or (n.input(2) and not n.is_constant(2)):
        return None
    shape = tuple(n.constant(1, "Scale").shape)
    if len(shape) != -axis or 1 in shape or (n.input(2) and tuple(n.constant(2, "B").shape) != shape):
        return None
    return shape


RULES: dict[str, Callable[[NodeView], Lowered]] = {
    "Conv": _conv_rule,
    "ConvTranspose": _conv_transpose_rule,
    "Gemm": _gemm_rule,
    "MatMul": lambda n: call(torch.matmul, (n.input(0), n.input(1))),
    "BatchNormalization": _batch_norm_rule,
    "LayerNormalization": _layer_norm_rule,
}

__all__ = ["RULES"]
