"""The KServe V2 / Triton HTTP frontend: ``build_app(server)`` returns its ASGI app."""

from __future__ import annotations

from kiln.frontends.http.app import build_app
from kiln.v2.http_body import DEFAULT_MAX_INPUT_SIZE

__all__ = ["DEFAULT_MAX_INPUT_SIZE", "build_app"]
