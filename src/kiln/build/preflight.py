"""Pre-flight: the nodes a backend cannot run, found before any build step starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx
import onnxruntime as ort

from kiln.errors import UnsupportedError

# Domains ONNX Runtime's CPU build implements besides the standard one.
_ORT_DOMAINS = {"", "ai.onnx", "ai.onnx.ml", "com.microsoft", "com.microsoft.nchwc", "com.ms.internal.nhwc"}


@dataclass(frozen=True)
class UnsupportedNode:
    op_type: str
    name: str
    domain: str
    reason: str

    def describe(self) -> str:
        domain = f"{self.domain}::" if self.domain else ""
        return f"{domain}{self.op_type} (node '{self.name}'): {self.reason}"


def raise_if_unsupported(backend: str, source: Path, nodes: list[UnsupportedNode]) -> None:
    if nodes:
        listed = "\n  ".join(node.describe() for node in nodes)
        raise UnsupportedError(f"{source}: the {backend} backend cannot run {len(nodes)} node(s):\n  {listed}")


def onnxruntime_unsupported(source: Path) -> list[UnsupportedNode]:
    """Nodes outside the operator sets ONNX Runtime knows; then a session is opened so anything else it rejects
    (an operator version it lacks, a bad attribute) is reported as a pre-flight failure, not a stack trace."""
    model = onnx.load(str(source), load_external_data=False)
    found: list[UnsupportedNode] = []
    for index, node in enumerate(model.graph.node):
        name = node.name or f"#{index}"
        if node.domain not in _ORT_DOMAINS:
            found.append(UnsupportedNode(node.op_type, name, node.domain, "custom operator domain; ONNX Runtime "
                                         "needs a custom-op library for it"))
        elif node.domain in ("", "ai.onnx") and not onnx.defs.has(node.op_type):
            found.append(UnsupportedNode(node.op_type, name, node.domain, "not an ONNX operator"))
    if found:
        return found
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        ort.InferenceSession(str(source), sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's own exception types; the message names the node
        return [UnsupportedNode("?", "?", "", f"onnxruntime rejects the model: {exc}")]
    return []
