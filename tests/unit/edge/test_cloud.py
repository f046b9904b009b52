"""The cloud client's address parsing and error texts (requests over sockets: tests/integration/test_edge.py)."""

from __future__ import annotations

import pytest

from kiln.edge.cloud import CloudClient, _error_text, parse_url
from kiln.errors import ConfigError


@pytest.mark.parametrize(("url", "expected"), [
    ("127.0.0.1:8000", ("127.0.0.1", 8000)),
    ("http://cloud.example:9000", ("cloud.example", 9000)),
    ("http://cloud.example/", ("cloud.example", 80)),
])
def test_urls(url: str, expected: tuple[str, int]) -> None:
    assert parse_url(url) == expected


@pytest.mark.parametrize("url", ["https://cloud:443", "http://cloud:8000/v2", "cloud:port", "http://"])
def test_bad_urls_are_refused(url: str) -> None:
    with pytest.raises(ConfigError, match="cloud url"):
        parse_url(url)


def test_infer_path_quotes_the_model_name_and_carries_the_version() -> None:
    assert CloudClient("h:1", "a b/c").path == "/v2/models/a%20b%2Fc/infer"
    assert CloudClient("h:1", "mlp", version="3").path == "/v2/models/mlp/versions/3/infer"


def test_error_text_reads_the_kserve_error_body() -> None:
    assert _error_text(b'{"error": "model not found"}') == "model not found"
    assert _error_text(b"<html>bad gateway</html>") == "<html>bad gateway</html>"
    assert _error_text(b'{"detail": 1}') == '{"detail": 1}'
