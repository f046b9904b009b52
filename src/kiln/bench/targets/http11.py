"""A small keep-alive HTTP/1.1 client on asyncio streams: one connection, one request at a time.

A load generator needs little of HTTP (POST and GET on one persistent connection, Content-Length or chunked
bodies) and must cost the client as little as possible on a small machine, so this is the whole client rather
than a general-purpose library. It records when the request was written and when the response head arrived, the
split between client send, response wait and client receive that perf_analyzer reports.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from kiln.errors import UnavailableError

T = TypeVar("T")

MAX_HEAD_BYTES = 64 * 1024


class HttpError(UnavailableError):
    """A protocol problem or a broken connection (the connection is closed; the next request reopens it)."""


@dataclass(frozen=True)
class HttpResponse:
    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes
    sent_ns: int  # monotonic time the request was fully written
    head_ns: int  # monotonic time the response head was read


class HttpConnection:
    def __init__(self, host: str, port: int, timeout_s: float = 60.0) -> None:
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: Mapping[str, str] | None = None) -> HttpResponse:
        """One exchange. A kept-alive connection the server has meanwhile closed (its keep-alive timeout) is
        reopened and the request sent again once: the server answered nothing on it, so nothing ran twice."""
        try:
            reused = await self._connect()
            try:
                return await with_timeout(self._exchange(method, path, body, headers or {}), self.timeout_s)
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                if not reused or (isinstance(exc, asyncio.IncompleteReadError) and exc.partial):
                    raise
                await self.close()
                await self._connect()
                return await with_timeout(self._exchange(method, path, body, headers or {}), self.timeout_s)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                ValueError) as exc:
            await self.close()
            raise HttpError(f"{method} http://{self.host}:{self.port}{path}: {type(exc).__name__}: {exc}") from exc

    async def _connect(self) -> bool:
        """Open the connection unless a usable one is there; True when an existing one is reused."""
        if self._writer is not None and self._reader is not None and not self._writer.is_closing() \
                and not self._reader.at_eof():
            return True
        await self.close()
        self._reader, self._writer = await with_timeout(
            asyncio.open_connection(self.host, self.port, limit=MAX_HEAD_BYTES), self.timeout_s)
        return False

    async def _exchange(self, method: str, path: str, body: bytes, headers: Mapping[str, str]) -> HttpResponse:
        reader, writer = self._reader, self._writer
        assert reader is not None and writer is not None
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", f"Content-Length: {len(body)}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        writer.writelines([("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"), body])
        await writer.drain()
        sent_ns = time.monotonic_ns()
        head = await reader.readuntil(b"\r\n\r\n")
        head_ns = time.monotonic_ns()
        status, response_headers = parse_head(head)
        data = await _read_body(reader, response_headers)
        if response_headers.get("connection", "").lower() == "close" or "content-length" not in response_headers \
                and "chunked" not in response_headers.get("transfer-encoding", ""):
            await self.close()
        return HttpResponse(status, response_headers, data, sent_ns, head_ns)

    async def close(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """Status code and lower-case headers of a response head (status line + header lines + blank line)."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"malformed header line: {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _read_body(reader: asyncio.StreamReader, headers: Mapping[str, str]) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        chunks: list[bytes] = []
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers end with a blank line
                    pass
                return b"".join(chunks)
            chunks.append(await reader.readexactly(size))
            await reader.readexactly(2)
    length = headers.get("content-length")
    if length is not None:
        return await reader.readexactly(int(length))
    return await reader.read()  # no length: the body runs until the server closes the connection


async def with_timeout(coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
    """``await coro`` limited to ``timeout_s``; asyncio.timeout where it exists (no extra task per request)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout_s):
            return await coro
    return await asyncio.wait_for(coro, timeout_s)
