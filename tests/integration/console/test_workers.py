"""With HTTP worker processes the console's routes are forwarded to the server process and answer the same."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from kiln.console import OPENAPI_PATH, STATUS_PATH
from kiln.demo import build_demo_repository
from kiln.testing.serve import kiln_serve


def test_console_through_http_workers(tmp_path: Path) -> None:
    build_demo_repository(tmp_path / "repo")
    with kiln_serve([tmp_path / "repo"], "--http-workers", "2", "--exit-timeout-secs", "5") as server:
        base = f"http://{server.http_url}"
        with urllib.request.urlopen(base + "/console") as page:
            assert page.headers["content-type"].startswith("text/html") and b"console.js" in page.read()
        with urllib.request.urlopen(base + "/console/static/console.js") as script:
            assert b"/v2/kiln/console/status" in script.read()
        with urllib.request.urlopen(base + STATUS_PATH) as status:
            assert "simple" in {m["name"] for m in json.load(status)["models"]}
        with urllib.request.urlopen(base + OPENAPI_PATH) as document:
            assert json.load(document)["openapi"] == "3.1.0"
