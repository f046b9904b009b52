"""The layer rule of docs/architecture.md as a whitelist: every area of the package names the kiln areas and the
third-party packages it may import. Anything not listed fails, so a new import across layers is a decision made
here, in review, not an accident. The standard library is allowed everywhere.

Imports are read from the syntax tree: ``import x``, ``from x import y``, ``from kiln import area`` (an area),
``from kiln import Name`` (the public API, ``kiln``), and ``importlib.import_module("...")`` / ``__import__`` with
a literal name, inside functions too.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "kiln"

BASE = {"errors", "tensor"}
PROTOCOL = BASE | {"v2", "_proto_pool"}
MODELS = PROTOCOL | {"config", "engines", "batching", "direct", "_files", "_flags"}
# Product areas beside the server use the protocol, the engines, the direct API and the public API (``kiln``:
# ``kiln.load``, ``kiln.Server``); a server only as a child process (serve_process) or through the client.
PRODUCT = MODELS | {"kiln", "serve_process"}

RULES: dict[str, tuple[set[str], set[str]]] = {
    # area: (kiln areas it may import, third-party packages it may import)
    "errors": (set(), set()),
    "tensor": ({"errors"}, {"numpy", "ml_dtypes"}),
    "_files": (set(), set()),
    "_flags": ({"errors"}, set()),
    "_proto_pool": (set(), {"google"}),
    "heap": (set(), set()),  # malloc settings for kiln's serving processes: theirs, and the cluster replicas'
    "compile_workers": (set(), set()),  # torch.compile's worker pool, stopped by kiln serve once its models loaded
    "v2": (BASE | {"_proto_pool"}, {"numpy", "orjson", "google", "grpc", "starlette"}),
    "config": (PROTOCOL | {"_files"}, {"numpy", "onnx", "google"}),
    "engines": (PROTOCOL | {"config", "_files"}, {"numpy", "ml_dtypes", "onnx", "onnxruntime", "torch", "tensorrt"}),
    "batching": (PROTOCOL | {"config", "engines"}, {"numpy"}),
    "direct": (PROTOCOL | {"config", "engines", "batching"}, {"numpy"}),
    "server": (MODELS | {"kiln"}, {"numpy", "google", "torch"}),
    # uvicorn: the HTTP worker processes run it; orjson: their descriptors (frontends/http/worker.py, handoff/).
    "frontends": (PROTOCOL | {"config", "server", "kiln", "console", "heap"},
                  {"numpy", "starlette", "grpc", "grpc_health", "prometheus_client", "psutil", "uvloop", "pynvml",
                   "uvicorn", "orjson"}),
    # The browser console: pages and a status document over the Server, mounted by the HTTP frontend; GPU figures
    # through the metrics frontend's NVML collector.
    "console": (PROTOCOL | {"server", "frontends", "kiln"}, {"starlette", "prometheus_client"}),
    "service": (PROTOCOL | {"config", "server", "frontends", "service_options", "kiln", "console", "heap",
                            "compile_workers"},
                {"starlette", "uvicorn", "uvloop"}),
    "service_options": (PROTOCOL | {"_flags", "server", "frontends"}, set()),
    "serve_process": (PROTOCOL, set()),
    "build": (MODELS, {"numpy", "onnx", "onnxruntime", "torch", "tensorrt"}),
    "bench": (PRODUCT, {"numpy", "grpc", "matplotlib", "psutil", "uvloop", "pynvml"}),
    "advise": (PRODUCT, {"numpy"}),
    "edge": (PRODUCT, {"numpy", "starlette", "uvicorn"}),
    "demo": ({"_files", "errors", "tensor"}, {"numpy", "onnx", "triton_python_backend_utils"}),
    "testing": (PRODUCT | {"demo"}, {"numpy", "onnx"}),
    # The A/B report and the capture export read what a server wrote (its capture store, with the server's own
    # reader) and compare outputs as its shadow traffic does; they run no server and talk to one by the client.
    "ab": (PRODUCT | {"server"}, {"numpy"}),
    "capture": (PRODUCT | {"server"}, {"numpy"}),
    # kiln on a Ray cluster: each Ray Serve replica runs the public Server behind the HTTP frontend's app; config:
    # the repository's instance groups decide the GPUs a replica asks for.
    "cluster": (PROTOCOL | {"config", "frontends", "kiln", "heap"}, {"ray", "starlette", "orjson", "google"}),
    # The commands wire everything together; nothing imports them.
    "cli": (PRODUCT | {"server", "frontends", "service", "service_options", "build", "bench", "advise", "edge",
                       "demo", "ab", "capture", "cluster"}, {"numpy"}),
    "__init__": ({"errors", "tensor", "direct", "engines", "server", "build"}, set()),
}


def area_of(path: Path) -> str:
    first = path.relative_to(SRC).parts[0]
    return first.removesuffix(".py")


def areas() -> set[str]:
    return {area_of(p) for p in SRC.rglob("*.py") if "_generated" not in p.parts}


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted module) of every import in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "kiln":
                yield from ((node.lineno, _kiln_name(alias.name)) for alias in node.names)
            else:
                yield node.lineno, node.module
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func) and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            yield node.lineno, node.args[0].value


def _kiln_name(name: str) -> str:
    """``from kiln import x``: an area when x is one (a module or package), else the public API."""
    return f"kiln.{name}" if (SRC / name).is_dir() or (SRC / f"{name}.py").is_file() else "kiln"


def _is_dynamic_import(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or \
        (isinstance(func, ast.Name) and func.id in ("import_module", "__import__"))


def violations(area: str) -> list[str]:
    allowed_kiln, allowed_other = RULES[area]
    target = SRC / area if (SRC / area).is_dir() else SRC / f"{area}.py"
    files = [target] if target.is_file() else [p for p in target.rglob("*.py") if "_generated" not in p.parts]
    found: list[str] = []
    for path in files:
        for line, module in imports(path):
            parts = module.split(".")
            if parts[0] == "kiln":
                other = parts[1] if len(parts) > 1 else "kiln"
                if other != area and other not in allowed_kiln:
                    found.append(f"{path.relative_to(SRC)}:{line} imports {module}")
            elif parts[0] not in sys.stdlib_module_names and parts[0] not in allowed_other:
                found.append(f"{path.relative_to(SRC)}:{line} imports {module} (third-party)")
    return found


def test_every_area_has_a_rule() -> None:
    assert areas() <= set(RULES), f"areas without a rule in this test: {sorted(areas() - set(RULES))}"


@pytest.mark.parametrize("area", sorted(RULES))
def test_area_imports_only_what_its_rule_allows(area: str) -> None:
    assert not violations(area), f"{area} may import only {sorted(RULES[area][0])} of kiln:\n" + \
        "\n".join(violations(area))


def test_the_checker_sees_every_kind_of_import(tmp_path: Path) -> None:
    source = ("import kiln.server.server\nfrom kiln import frontends\nfrom kiln import load\n"
              "def f():\n    import importlib\n    importlib.import_module('kiln.bench')\n"
              "    __import__('kiln.edge')\n")
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    found = [module for _, module in imports(probe)]
    assert found == ["kiln.server.server", "kiln.frontends", "kiln", "importlib", "kiln.bench", "kiln.edge"]
