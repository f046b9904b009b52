"""kiln's browser console: a live status page and the API described (OpenAPI), served by `kiln serve`."""

from kiln.console.routes import OPENAPI_PATH, STATUS_PATH, ConsoleOptions, console_routes

__all__ = ["OPENAPI_PATH", "STATUS_PATH", "ConsoleOptions", "console_routes"]
