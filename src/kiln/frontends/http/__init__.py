"""The KServe V2 / Triton HTTP frontend: ``build_app(server)`` returns its ASGI app."""

from __future__ import annotations

from kiln.frontends.http.app import DEFAULT_MAX_INPUT_SIZE, build_app

__all__ = ["DEFAULT_MAX_INPUT_SIZE", "build_app"]
