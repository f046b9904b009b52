"""Walk an ONNX graph once: lower each node with its operator rule, fold constant nodes, collect what cannot be done."""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
import onnx.defs
import torch

from kiln.build.torch_convert import _ops_elementwise, _ops_linear, _ops_pool, _ops_reduce, _ops_resize, _ops_shape
from kiln.build.torch_convert._node import Constants, Lowered, NodeUnsupportedError, NodeView

MIN_OPSET = 11
MAX_OPSET = 21
DEFAULT_DOMAIN = "ai.onnx"

RULES = {
    **_ops_elementwise.RULES,
    **_ops_linear.RULES,
    **_ops_pool.RULES,
    **_ops_reduce.RULES,
    **_ops_resize.RULES,
    **_ops_shape.RULES,
}


@dataclass(frozen=True)
class UnsupportedNode:
    """A node the converter cannot turn into PyTorch, and why."""

    op_type: str
    name: str  # the node's name in the graph ('' when it has none; ``index`` still locates it)
    domain: str  # "ai.onnx" for the default domain
    reason: str
    index: int  # position in graph.node

    @property
    def label(self) -> str:
        return f"{self.name or f'#{self.index}'} ({self.op_type})"


@dataclass
class Plan:
    inputs: list[str]  # graph inputs fed at run time, in graph order
    outputs: list[str]
    constants: Constants
    steps: list[tuple[onnx.NodeProto, Lowered]] = field(default_factory=list)
    unsupported: list[UnsupportedNode] = field(default_factory=list)


def default_opset(model: onnx.ModelProto) -> int | None:
    for entry in model.opset_import:
        if entry.domain in ("", DEFAULT_DOMAIN):
            return int(entry.version)
    return None


def make_plan(model: onnx.ModelProto) -> Plan:
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    plan = Plan(inputs=[i.name for i in graph.input if i.name not in initializers],
                outputs=[o.name for o in graph.output], constants=Constants(initializers))
    opset = default_opset(model)
    runtime = set(plan.inputs)  # names whose values exist only at run time
    for index, node in enumerate(graph.node):
        try:
            lowered = _lower(node, opset, plan.constants, runtime)
            if _record_constant(node, lowered, plan.constants, runtime):
                continue
        except NodeUnsupportedError as exc:
            domain = node.domain or DEFAULT_DOMAIN
            plan.unsupported.append(UnsupportedNode(node.op_type, node.name, domain, str(exc), index))
        else:
            plan.steps.append((node, lowered))
        runtime.update(name for name in node.output if name)
    return plan


def _lower(node: onnx.NodeProto, opset: int | None, constants: Constants, runtime: set[str]) -> Lowered:
    if node.domain not in ("", DEFAULT_DOMAIN):
        raise NodeUnsupportedError(f"operators of domain '{node.domain}' are not supported (only {DEFAULT_DOMAIN})")
    if opset is None or not MIN_OPSET <= opset <= MAX_OPSET:
        found = "imports no ai.onnx opset" if opset is None else f"uses ai.onnx opset {opset}"
        raise NodeUnsupportedError(f"the model {found}; supported opsets are {MIN_OPSET}-{MAX_OPSET} "
                                   f"(onnx.version_converter can convert the model)")
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        raise NodeUnsupportedError(f"{node.op_type} is not an ai.onnx operator at opset {opset}") from None
    rule = RULES.get(node.op_type)
    if rule is None:
        raise NodeUnsupportedError(f"the converter has no rule for {node.op_type}")
    for name in node.input:
        if not name or name in runtime:
            continue
        if name not in constants:
            raise NodeUnsupportedError(f"input '{name}' is not a graph input, an initializer or the output of an "
                                       f"earlier node (nodes must be in topological order)")
        constants.check(name)
    view = NodeView(node, int(schema.since_version), constants)
    lowered = rule(view)
    view.outputs_used(lowered.outputs, "an extra output")
    return lowered


def _record_constant(node: onnx.NodeProto, lowered: Lowered, constants: Constants, runtime: set[str]) -> bool:
    """Keep the node's results as constants when they are known now (Constant, or every input constant)."""
    if lowered.constant is not None:
        constants.add(node.output[0], lowered.constant)
        return True
    names = (lowered.alias,) if lowered.alias is not None else tuple(n for n in lowered.inputs if n)
    if not names or any(n in runtime for n in names):
        return False
    if lowered.alias is not None:
        constants.add(node.output[0], constants.get(lowered.alias))
        return True
    assert lowered.fn is not None
    args = [constants.get(n) if n else None for n in lowered.inputs]
    try:
        with torch.no_grad():
            result = lowered.fn(*args, **lowered.kwargs)
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        raise NodeUnsupportedError(f"evaluating the node on its constant inputs failed: {exc}") from None
    results = (result,) if lowered.outputs == 1 else tuple(result)
    for name, value in zip(node.output, results, strict=False):
        if name:
            constants.add(name, value.contiguous())  # a view (Transpose, Slice) would keep its source alive
    return True


__all__ = ["DEFAULT_DOMAIN", "MAX_OPSET", "MIN_OPSET", "RULES", "Plan", "UnsupportedNode", "default_opset",
           "make_plan"]
