"""Starlette responses in the V2 shapes, for every HTTP server kiln runs (``kiln serve`` and ``kiln edge``):
JSON documents, and errors as ``{"error": message}`` with the status of the one table (:mod:`kiln.v2.status`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.responses import Response

from kiln.errors import ErrorCode
from kiln.v2.http_codec import JSON_TYPE, encode_json
from kiln.v2.status import as_kiln_error, error_body, http_status


def json_response(doc: Any, status_code: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(encode_json(doc), status_code=status_code, headers=headers, media_type=JSON_TYPE)


def error_response(exc: Exception) -> Response:
    """The response for any exception: typed errors keep their code, anything else is INTERNAL (logged once)."""
    error = as_kiln_error(exc)
    # RFC 9110: a 401 names the scheme that would be accepted.
    headers = {"WWW-Authenticate": "Bearer"} if error.code is ErrorCode.UNAUTHENTICATED else None
    return json_response(error_body(error), http_status(error), headers)
