"""The asyncio V2 HTTP client, on a small keep-alive HTTP/1.1 transport over asyncio streams.

A load generator needs little of HTTP (requests on persistent connections, Content-Length or chunked bodies) and
must cost the client as little as possible on a small machine, so the transport is written here rather than taken
from a general-purpose library; ``kiln bench`` runs on it. It records when a request was written and when the
answer's head arrived. :class:`AsyncHttpClient` keeps a pool of connections: concurrent tasks each take one.
"""

from __future__ import annotations

import asyncio
import ssl
import sys
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import numpy.typing as npt

from kiln.tensor import DataType
from kiln.v2.client import calls
from kiln.v2.client.calls import Call, Response
from kiln.v2.client.endpoint import endpoint
from kiln.v2.client.http import ServerUnreachableError, auth_headers
from kiln.v2.types import InferResponse

T = TypeVar("T")

MAX_HEAD_BYTES = 64 * 1024


class Connection:
    """One keep-alive connection, one request at a time."""

    def __init__(self, host: str, port: int, timeout_s: float = 60.0, tls: ssl.SSLContext | None = None) -> None:
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self.tls = tls
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: Mapping[str, str] | None = None) -> Response:
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
            raise ServerUnreachableError(f"{method} {self.host}:{self.port}{path}: {type(exc).__name__}: {exc}"
                                         ) from exc

    async def _connect(self) -> bool:
        """Open the connection unless a usable one is there; True when an existing one is reused."""
        if self._writer is not None and self._reader is not None and not self._writer.is_closing() \
                and not self._reader.at_eof():
            return True
        await self.close()
        self._reader, self._writer = await with_timeout(
            asyncio.open_connection(self.host, self.port, limit=MAX_HEAD_BYTES, ssl=self.tls), self.timeout_s)
        return False

    async def _exchange(self, method: str, path: str, body: bytes, headers: Mapping[str, str]) -> Response:
        reader, writer = self._reader, self._writer
        assert reader is not None and writer is not None
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", f"Content-Length: {len(body)}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        request_head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        # No empty buffer goes to the transport: CPython 3.12's sendmsg writer loops forever on one.
        if body:
            writer.writelines([request_head, body])
        else:
            writer.write(request_head)
        await writer.drain()
        sent_ns = time.monotonic_ns()
        head = await reader.readuntil(b"\r\n\r\n")
        head_ns = time.monotonic_ns()
        status, response_headers = parse_head(head)
        data = await _read_body(reader, response_headers)
        if response_headers.get("connection", "").lower() == "close" or "content-length" not in response_headers \
                and "chunked" not in response_headers.get("transfer-encoding", ""):
            await self.close()
        return Response(status, response_headers, data, sent_ns, head_ns)

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


class AsyncHttpClient:
    """The asyncio twin of :class:`kiln.v2.client.http.HttpClient`: the same calls, awaited."""

    def __init__(self, url: str, *, timeout_s: float = 60.0, api_key: str | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.endpoint = endpoint(url, tls)
        self.timeout_s = timeout_s
        self.headers = auth_headers(api_key)
        self._idle: list[Connection] = []
        self._all: set[Connection] = set()

    @property
    def url(self) -> str:
        return self.endpoint.url

    async def infer(self, model: str, inputs: Mapping[str, npt.NDArray[Any]], *, version: str = "",
                    outputs: Sequence[str] = (), binary: bool = True,
                    datatypes: Mapping[str, DataType] | None = None, parameters: Mapping[str, Any] | None = None,
                    request_id: str = "") -> InferResponse:
        return await self.send(calls.infer(model, inputs, version=version, outputs=outputs, binary=binary,
                                           datatypes=datatypes, parameters=parameters, request_id=request_id))

    async def live(self) -> bool:
        return await self.send(calls.live())

    async def ready(self) -> bool:
        return await self.send(calls.ready())

    async def model_ready(self, model: str, version: str = "") -> bool:
        return await self.send(calls.model_ready(model, version))

    async def server_metadata(self) -> Any:
        return await self.send(calls.server_metadata())

    async def model_metadata(self, model: str, version: str = "") -> Any:
        return await self.send(calls.model_metadata(model, version))

    async def model_config(self, model: str, version: str = "") -> Any:
        return await self.send(calls.model_config(model, version))

    async def statistics(self, model: str = "", version: str = "") -> Any:
        return await self.send(calls.statistics(model, version))

    async def repository_index(self, ready_only: bool = False) -> Any:
        return await self.send(calls.repository_index(ready_only))

    async def load_model(self, model: str, config: str | None = None,
                         files: Mapping[str, bytes] | None = None) -> None:
        await self.send(calls.load_model(model, config, files))

    async def unload_model(self, model: str, unload_dependents: bool = False) -> None:
        await self.send(calls.unload_model(model, unload_dependents))

    async def get(self, path: str) -> Any:
        return await self.send(calls.get(path))

    async def post(self, path: str, doc: object = None) -> Any:
        return await self.send(calls.post(path, doc))

    async def send(self, call: Call[T]) -> T:
        return call.parse(await self.request(call.method, call.path, call.body, call.headers))

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: Mapping[str, str] | None = None) -> Response:
        connection = self._idle.pop() if self._idle else self._new_connection()
        try:
            return await connection.request(method, path, body, {**self.headers, **(headers or {})})
        finally:
            self._idle.append(connection)

    def _new_connection(self) -> Connection:
        connection = Connection(self.endpoint.host, self.endpoint.port, self.timeout_s, self.endpoint.context)
        self._all.add(connection)
        return connection

    async def close(self) -> None:
        connections, self._all, self._idle = self._all, set(), []
        for connection in connections:
            await connection.close()

    async def __aenter__(self) -> AsyncHttpClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
