"""Reading request bodies: the size limit (Triton's ``--http-max-input-size``), gzip / deflate decoding and JSON
parsing with the error position.

The limit is enforced before anything is buffered when ``Content-Length`` announces too much, and while
streaming otherwise, so an oversized body is never held in memory. It applies to the decompressed size too.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, Protocol

import orjson

from kiln.errors import CancelledError, InvalidArgumentError

DEFAULT_MAX_INPUT_SIZE = 64 * 2**20
"""Triton's ``--http-max-input-size`` default (``HTTP_DEFAULT_MAX_INPUT_SIZE``)."""

_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class AsgiRequest(Protocol):
    """What body reading needs of a request (a ``starlette.requests.Request`` is one)."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def receive(self) -> Callable[[], Awaitable[MutableMapping[str, Any]]]: ...


def _too_large(size: int, limit: int, *, at_least: bool = False, what: str = "request body") -> InvalidArgumentError:
    more = "at least " if at_least else ""
    return InvalidArgumentError(
        f"{what} of {more}{size} bytes exceeds the limit of {limit} bytes (--http-max-input-size)"
    )


async def read_body(request: AsgiRequest, limit: int) -> bytes:
    """The request body, decompressed per ``Content-Encoding``, never more than ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdecimal() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    # ASGI messages read directly: Request.stream() costs an async generator per request on the hot path.
    receive = request.receive
    chunks: list[bytes] = []
    total = 0
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise CancelledError("the client disconnected while sending the request body")
        chunk: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        if chunk:
            total += len(chunk)
            if total > limit:
                raise _too_large(total, limit, at_least=True)
            chunks.append(chunk)
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    encoding = request.headers.get("content-encoding")
    if encoding is None or not body:
        return body
    return decompress(body, encoding, limit)


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """Decode a gzip or deflate (zlib) body without ever inflating more than ``limit`` + 1 bytes."""
    name = encoding.strip().lower()
    if name in ("", "identity"):
        return body
    wbits = _WBITS.get(name)
    if wbits is None:
        # The client's choice, not a missing server feature: 400 (INVALID_ARG) rather than 501.
        raise InvalidArgumentError(f"Content-Encoding '{encoding}' is not supported; send the request body as "
                                   f"gzip, deflate (zlib), or identity (uncompressed)")
    inflater = zlib.decompressobj(wbits)
    try:
        data = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise InvalidArgumentError(f"the request body is not valid {name} data ({exc})") from None
    if len(data) > limit:
        raise _too_large(len(data), limit, at_least=True, what="decompressed request body")
    if not inflater.eof:
        raise InvalidArgumentError(f"the {name} request body is truncated: the compressed stream does not end")
    return data


def parse_json(data: bytes, what: str = "request body") -> Any:
    """Parse JSON; a syntax error names the line, column and byte offset where parsing stopped."""
    try:
        return orjson.loads(data)
    except json.JSONDecodeError as exc:  # orjson's error type derives from it and carries the position
        if "depth limit" in exc.msg:
            raise InvalidArgumentError(f"the {what} is nested too deeply to parse") from None
        if "UTF-8" in exc.msg:
            raise InvalidArgumentError(f"the {what} is not UTF-8 text: {exc.msg} (char {exc.pos})") from None
        raise InvalidArgumentError(
            f"malformed JSON in the {what} at line {exc.lineno} column {exc.colno} (char {exc.pos}): {exc.msg}"
        ) from None
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(f"the {what} is not UTF-8 text: invalid byte at offset {exc.start}") from None
    except RecursionError:
        raise InvalidArgumentError(f"the {what} is nested too deeply to parse") from None
