"""The cloud client's address parsing and error texts (requests over sockets: tests/integration/test_edge.py)."""

from __future__ import annotations

import pytest

from kiln.edge.cloud import CloudClient, parse_url
from kiln.errors import ConfigError


@pytest.mark.parametrize(("url", "expected"), [
    ("127.0.0.1:8000", ("127.0.0.1", 8000)),
    ("http://cloud.example:9000", ("cloud.example", 9000)),
    ("http://cloud.example/", ("cloud.example", 80)),
    ("https://cloud.example", ("cloud.example", 443)),
])
def test_urls(url: str, expected: tuple[str, int]) -> None:
    assert parse_url(url) == expected


@pytest.mark.parametrize("url", ["ftp://cloud:21", "http://cloud:8000/v2", "cloud:port", "http://"])
def test_bad_urls_are_refused(url: str) -> None:
    with pytest.raises(ConfigError, match="cloud url"):
        parse_url(url)


def test_infer_path_quotes_the_model_name_and_carries_the_version() -> None:
    assert CloudClient("h:1", "a b/c").path == "/v2/models/a%20b%2Fc/infer"
    assert CloudClient("h:1", "mlp", version="3").path == "/v2/models/mlp/versions/3/infer"


def test_the_api_key_goes_with_every_infer_request() -> None:
    import http.server
    import threading

    import numpy as np

    seen: list[str | None] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append(self.headers.get("Authorization"))
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b'{"error": "no such model"}'
            self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = CloudClient(f"127.0.0.1:{server.server_address[1]}", "mlp", api_key="s3cret")
        result = client.infer({"x": np.zeros((1, 2), np.float32)})
        client.close()
        assert result.status == "failed"
        assert seen == ["Bearer s3cret"]
    finally:
        server.shutdown()
        server.server_close()
