"""The load generator's HTTP/1.1 response parsing, fed from memory (the connection itself runs in
tests/integration/test_bench.py against a real server)."""

from __future__ import annotations

import asyncio

import pytest

from kiln.v2.client.aio import _read_body, parse_head


def test_head_gives_status_and_lower_case_headers() -> None:
    status, headers = parse_head(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
                                 b"Inference-Header-Content-Length: 12\r\n\r\n")
    assert status == 400
    assert headers == {"content-type": "application/json", "inference-header-content-length": "12"}


@pytest.mark.parametrize("head", [b"HTTP/2 200\r\n\r\n", b"garbage\r\n\r\n", b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n"])
def test_malformed_heads_are_refused(head: bytes) -> None:
    with pytest.raises(ValueError):
        parse_head(head)


async def read(data: bytes, headers: dict[str, str]) -> tuple[bytes, bytes]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    body = await _read_body(reader, headers)
    return body, await reader.read()


async def test_content_length_body_leaves_the_next_response_alone() -> None:
    assert await read(b"hello worldHTTP/1.1", {"content-length": "11"}) == (b"hello world", b"HTTP/1.1")


async def test_chunked_body_is_joined_and_trailers_skipped() -> None:
    data = b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\nnext"
    assert await read(data, {"transfer-encoding": "chunked"}) == (b"hello world", b"next")


async def test_a_body_without_length_runs_to_the_end_of_the_connection() -> None:
    assert await read(b"all of it", {}) == (b"all of it", b"")
