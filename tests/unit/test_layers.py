"""The layering rule from the design: the core never imports a transport, engines never import the server."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "kiln"

TRANSPORTS = ("starlette", "uvicorn", "grpc", "prometheus_client", "httpx", "kiln.frontends", "kiln.service")
# The command line is the top: no library module imports it (kiln/cli/ is wiring over them).
CLI = "kiln.cli"

RULES = {
    "server": TRANSPORTS,
    "engines": (*TRANSPORTS, "kiln.server"),
    "config": (*TRANSPORTS, "kiln.server", "kiln.engines"),
    "errors.py": ("kiln.",),
    "tensor.py": (*TRANSPORTS, "kiln.server", "kiln.engines", "kiln.config"),
    "direct.py": (*TRANSPORTS, "kiln.server"),
    # The builder works on model files and engines; it never needs a server or a transport.
    "build": (*TRANSPORTS, "kiln.server", "kiln.bench", "kiln.advise", CLI),
    # advise reads result files; bench is a client and drives servers only through their protocols or Server.
    "advise": (*TRANSPORTS, "kiln.server", "kiln.engines", "kiln.build", "kiln.bench", CLI),
    "bench": ("kiln.frontends.http", "kiln.service", "starlette", "uvicorn", "kiln.build", "kiln.advise", CLI),
    # The edge runs an engine and an HTTP endpoint of its own; it never runs the server's service or builds.
    "edge": ("kiln.service", "kiln.build", "kiln.advise", CLI),
    # The A/B report and the capture export read a server's answers and its capture store; they run no server.
    "ab": (*TRANSPORTS, "kiln.build", "kiln.bench", "kiln.advise", "kiln.edge", CLI),
    "capture": (*TRANSPORTS, "kiln.build", "kiln.bench", "kiln.advise", "kiln.edge", CLI),
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("area", sorted(RULES))
def test_layer_does_not_import_higher_layers(area: str) -> None:
    target = SRC / area
    files = [target] if target.is_file() else [p for p in target.rglob("*.py") if "_generated" not in p.parts]
    assert files
    for path in files:
        for module in imported_modules(path):
            for forbidden in RULES[area]:
                assert not (module == forbidden.rstrip(".") or module.startswith(forbidden.rstrip(".") + ".")
                            or (forbidden.endswith(".") and module.startswith(forbidden))), (
                    f"{path.relative_to(SRC)} imports {module}, which {area} must not import")
