"""The OpenAPI document and the HTTP app's real route table describe the same API."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.routing import Route

from kiln.console import ConsoleOptions
from kiln.console.openapi import OPERATIONS, openapi_document, openapi_path
from kiln.frontends.http import build_app
from kiln.server.server import Server, ServerOptions


def _app_routes(tmp_path: Path) -> set[tuple[str, str]]:
    app = build_app(Server(ServerOptions(repositories=[tmp_path])), console=ConsoleOptions(enabled=True))
    routes = [r for r in app.app.routes if isinstance(r, Route)]
    assert len(routes) == len(app.app.routes), "every route of the app is a plain Route"
    return {(openapi_path(r.path), m) for r in routes for m in (r.methods or ()) if m != "HEAD"}


def test_every_route_of_the_app_is_documented_and_every_documented_route_exists(tmp_path: Path) -> None:
    served = _app_routes(tmp_path)
    doc = openapi_document()
    documented = {(path, method.upper()) for path, ops in doc["paths"].items() for method in ops}
    assert served - documented == set(), "routes the document lacks"
    assert documented - served == set(), "documented routes the app does not serve"


def test_the_document_is_openapi_3_1_with_resolvable_references() -> None:
    doc = openapi_document()
    assert doc["openapi"] == "3.1.0"
    schemas = doc["components"]["schemas"]
    refs: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            refs.extend([node["$ref"]] if "$ref" in node else [])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    assert refs and all(r.removeprefix("#/components/schemas/") in schemas for r in refs)
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)) == len(OPERATIONS)


def test_path_parameters_are_declared() -> None:
    for path, ops in openapi_document()["paths"].items():
        for op in ops.values():
            declared = {p["name"] for p in op["parameters"]}
            assert declared == {part[1:-1] for part in path.split("/") if part.startswith("{")}, path


def test_every_schema_is_valid_json_schema_2020_12() -> None:
    """OpenAPI 3.1's schemas are JSON Schema 2020-12 (jsonschema comes with the dev extra's kubernetes-validate)."""
    jsonschema = pytest.importorskip("jsonschema")
    for name, schema in openapi_document()["components"]["schemas"].items():
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise AssertionError(f"schema {name}: {exc.message}") from None
