"""Resize, for the cases F.interpolate computes exactly: constant spatial scales, and

- mode nearest with coordinate_transformation_mode asymmetric and nearest_mode floor (torch's "nearest"), or
- mode linear with half_pixel / pytorch_half_pixel (align_corners=False) or align_corners, without antialias.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kiln.build.torch_convert._node import Lowered, NodeUnsupportedError, NodeView, call

_LINEAR = {1: "linear", 2: "bilinear", 3: "trilinear"}
_LINEAR_COORDINATES = {"half_pixel": False, "pytorch_half_pixel": False, "align_corners": True}


def _resize(x: torch.Tensor, *, scales: tuple[float, ...], mode: str, align_corners: bool | None) -> torch.Tensor:
    # With recompute_scale_factor=False, torch maps coordinates with the given scale, as ONNX does.
    return F.interpolate(x, scale_factor=scales, mode=mode, align_corners=align_corners,
                         recompute_scale_factor=False)


def _scales(n: NodeView) -> tuple[float, ...]:
    if n.has_attr("axes"):
        raise NodeUnsupportedError("the axes attribute is not supported; give scales for every axis")
    if n.input(3):
        raise NodeUnsupportedError("sizes is not supported; give constant scales")
    scales = tuple(float(v) for v in n.constant(2, "scales").reshape(-1).tolist())
    if not 3 <= len(scales) <= 5 or scales[0] != 1.0 or scales[1] != 1.0:
        raise NodeUnsupportedError(f"scales {list(scales)}: only 1-3 spatial axes are resized, with scale 1 on the "
                                   f"batch and channel axes")
    return scales[2:]


def _resize_rule(n: NodeView) -> Lowered:
    mode = n.attr_str("mode", "nearest")
    coordinates = n.attr_str("coordinate_transformation_mode", "half_pixel")
    if n.attr_int("antialias", 0) or n.attr_int("exclude_outside", 0):
        raise NodeUnsupportedError("antialias and exclude_outside are not supported")
    if mode == "nearest":
        nearest_mode = n.attr_str("nearest_mode", "round_prefer_floor")
        if coordinates != "asymmetric" or nearest_mode != "floor":
            raise NodeUnsupportedError(f"mode nearest needs coordinate_transformation_mode 'asymmetric' and "
                                       f"nearest_mode 'floor'; got '{coordinates}' and '{nearest_mode}'")
        return call(_resize, (n.input(0),), scales=_scales(n), mode="nearest", align_corners=None)
    if mode == "linear":
        if coordinates not in _LINEAR_COORDINATES:
            raise NodeUnsupportedError(f"mode linear with coordinate_transformation_mode '{coordinates}' is not "
                                       f"supported (supported: {', '.join(_LINEAR_COORDINATES)})")
        scales = _scales(n)
        return call(_resize, (n.input(0),), scales=scales, mode=_LINEAR[len(scales)],
                    align_corners=_LINEAR_COORDINATES[coordinates])
    raise NodeUnsupportedError(f"mode '{mode}' is not supported (nearest and linear are)")


RULES: dict[str, Callable[[NodeView], Lowered]] = {"Resize": _resize_rule}

__all__ = ["RULES"]
