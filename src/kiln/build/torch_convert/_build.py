"""Turn a plan into a torch.fx GraphModule: one placeholder per graph input, one buffer per constant used at run
time, one call per node, in graph order."""

from __future__ import annotations

import builtins
import keyword
import operator
import re

import torch
import torch.fx as fx

from kiln.build.torch_convert._node import NodeUnsupportedError
from kiln.build.torch_convert._plan import Plan
from kiln.errors import InvalidArgumentError, UnsupportedError

# Names the generated forward() must not shadow or that the module already uses.
_RESERVED = {"self", "torch", "fx", "operator", "inf", "nan", "device"} | set(dir(builtins)) | set(dir(fx.GraphModule))


class OnnxGraphModule(fx.GraphModule):
    """A converted ONNX graph. ``onnx_inputs`` / ``onnx_outputs`` are the ONNX names of forward's positional
    arguments and of the tuple it returns, in graph order."""

    onnx_inputs: tuple[str, ...]
    onnx_outputs: tuple[str, ...]


class _Names:
    """Unique Python identifiers derived from ONNX names (which may hold '.', ':', '/' or start with a digit)."""

    def __init__(self) -> None:
        self._used: set[str] = set()

    def new(self, onnx_name: str) -> str:
        base = re.sub(r"\W", "_", onnx_name) or "value"
        if base[0].isdigit() or keyword.iskeyword(base) or base in _RESERVED:
            base = f"v_{base}"
        name, suffix = base, 1
        while name in self._used:
            name, suffix = f"{base}_{suffix}", suffix + 1
        self._used.add(name)
        return name


class _Builder:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.graph = fx.Graph()
        self.root = torch.nn.Module()
        self.names = _Names()
        self.env: dict[str, fx.Node] = {}
        self.buffers: dict[int, fx.Node] = {}  # one buffer per constant tensor, however many names alias it

    def value(self, name: str) -> fx.Node:
        node = self.env.get(name)
        if node is not None:
            return node
        if name not in self.plan.constants:
            raise InvalidArgumentError(f"ONNX graph: value '{name}' is used but no graph input, initializer or "
                                       f"node produces it")
        try:
            tensor = self.plan.constants.get(name)
        except NodeUnsupportedError as exc:  # only a graph output read straight from an initializer gets here
            raise UnsupportedError(f"ONNX graph: output '{name}': {exc}") from None
        node = self.buffers.get(id(tensor))
        if node is None:
            attr = self.names.new(name)
            self.root.register_buffer(attr, tensor)
            node = self.graph.get_attr(attr)
            self.buffers[id(tensor)] = node
        self.env[name] = node
        return node

    def build(self, graph_name: str) -> OnnxGraphModule:
        for name in self.plan.inputs:
            self.env[name] = self.graph.placeholder(self.names.new(name))
        for onnx_node, lowered in self.plan.steps:
            outputs = list(onnx_node.output)
            if lowered.alias is not None:
                self.env[outputs[0]] = self.value(lowered.alias)
                continue
            assert lowered.fn is not None  # the plan keeps only calls and aliases
            args = tuple(self.value(n) if n else None for n in lowered.inputs)
            result = self.graph.call_function(lowered.fn, args, dict(lowered.kwargs),
                                              name=re.sub(r"\W", "_", onnx_node.name) or onnx_node.op_type.lower())
            if lowered.outputs == 1:
                self.env[outputs[0]] = result
                continue
            for i, out in enumerate(outputs):
                if out:
                    self.env[out] = self.graph.call_function(operator.getitem, (result, i))
        self.graph.output(tuple(self.value(n) for n in self.plan.outputs))
        module = OnnxGraphModule(self.root, self.graph, class_name=_class_name(graph_name))
        module.onnx_inputs = tuple(self.plan.inputs)
        module.onnx_outputs = tuple(self.plan.outputs)
        module.eval()
        return module


def _class_name(graph_name: str) -> str:
    words = re.findall(r"[A-Za-z0-9]+", graph_name)
    name = "".join(w[:1].upper() + w[1:] for w in words)
    return f"Onnx{name}" if name and not name[0].isdigit() else "OnnxGraph"


def build_module(plan: Plan, graph_name: str) -> OnnxGraphModule:
    return _Builder(plan).build(graph_name)


__all__ = ["OnnxGraphModule", "build_module"]
