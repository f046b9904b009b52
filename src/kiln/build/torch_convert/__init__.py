"""ONNX -> PyTorch for a documented operator set (ONNX opsets 11-21, default domain).

``convert(model)`` returns a ``torch.fx.GraphModule`` (:class:`OnnxGraphModule`) whose ``forward`` takes the graph
inputs positionally in graph order (initializers listed as inputs are constants, not inputs) and returns a tuple of
the graph outputs in graph order. Weights are registered buffers, so ``.to(device)``, ``.half()`` and
``state_dict()`` work. Attributes and constant inputs (shapes, axes, pads, ...) are read at conversion time, so the
module has static control flow and can be traced with ``torch.jit.trace`` or exported with ``torch.export.export``,
with a dynamic batch axis.

``unsupported_nodes(model)`` is the pre-flight check: every node the converter cannot handle and why (operators
outside the table, other domains, attributes or inputs the rules do not implement, opsets outside 11-21).
``convert`` raises :class:`kiln.errors.UnsupportedError` listing all of them at once.
"""

from __future__ import annotations

import onnx

from kiln.build.torch_convert._build import OnnxGraphModule, build_module
from kiln.build.torch_convert._plan import MAX_OPSET, MIN_OPSET, RULES, UnsupportedNode, make_plan
from kiln.errors import InvalidArgumentError, UnsupportedError

SUPPORTED_OPS: frozenset[str] = frozenset(RULES)


def unsupported_nodes(model: onnx.ModelProto) -> list[UnsupportedNode]:
    """Every node of ``model`` that :func:`convert` cannot turn into PyTorch, in graph order; empty when all can."""
    _check_model(model)
    return make_plan(model).unsupported


def convert(model: onnx.ModelProto) -> OnnxGraphModule:
    """The ONNX graph as a PyTorch module (in eval mode); raises UnsupportedError naming every unsupported node."""
    _check_model(model)
    plan = make_plan(model)
    if plan.unsupported:
        raise UnsupportedError(describe_unsupported(model.graph.name, plan.unsupported))
    return build_module(plan, model.graph.name)


def describe_unsupported(graph_name: str, nodes: list[UnsupportedNode]) -> str:
    """One message for many nodes: nodes that share a reason share a line."""
    by_reason: dict[str, list[str]] = {}
    for node in nodes:
        by_reason.setdefault(node.reason, []).append(node.label)
    lines = [f"  - {', '.join(labels)}: {reason}" for reason, labels in by_reason.items()]
    return (f"ONNX graph '{graph_name}': {len(nodes)} node(s) cannot be converted to PyTorch "
            f"(supported: ai.onnx opsets {MIN_OPSET}-{MAX_OPSET}, operators {', '.join(sorted(SUPPORTED_OPS))}):\n"
            + "\n".join(lines))


def _check_model(model: object) -> None:
    if not isinstance(model, onnx.ModelProto):
        raise InvalidArgumentError(f"expected an onnx.ModelProto, got {type(model).__name__}; "
                                   f"load the file with onnx.load(path)")


__all__ = ["MAX_OPSET", "MIN_OPSET", "SUPPORTED_OPS", "OnnxGraphModule", "UnsupportedNode", "convert",
           "describe_unsupported", "unsupported_nodes"]
