"""Shared by the console's tests: validators of the OpenAPI document's schemas."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kiln.console.openapi import openapi_document


@pytest.fixture
def schema_validator() -> Callable[[str], Any]:
    """``schema_validator(name)``: a validator of the document's schema ``name``, its references resolved inside
    the document (OpenAPI 3.1's schemas are JSON Schema 2020-12)."""
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (with the dev extra) validates the answers")
    document = openapi_document()
    return lambda name: jsonschema.Draft202012Validator({**document, "$ref": f"#/components/schemas/{name}"})
