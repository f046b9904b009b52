"""Limits on what one HTTP connection may cost: request-head size and header count, and how long a client may
take to send a head or a body.

uvicorn with httptools sets none of these itself: httptools buffers a header of any size until it ends, and a
connection that sends nothing, or a byte a second, stays open for good. :class:`LimitedHttpToolsProtocol` is
uvicorn's protocol with them added; the listener (listener.py) caps the number of open connections. The idle
keep-alive timeout is uvicorn's own ``timeout_keep_alive``. Defaults follow nginx and Envoy; docs/serving.md,
"Limits and timeouts", lists them with their flags.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("kiln.http")


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = 64 * 2**10
    """Request line plus headers, in bytes (nginx's large_client_header_buffers allow 4 x 8 KiB per line; Envoy's
    max_request_headers_kb is 60)."""
    max_headers: int = 100
    """Header fields in one request (Envoy's max_headers_count default)."""
    header_timeout_s: float = 30.0
    """From connection start, or from a keep-alive request's first byte, until its head is complete."""
    idle_timeout_s: float = 60.0
    """A keep-alive connection with no request in progress is closed after this long."""
    body_timeout_s: float = 300.0
    """From the end of the head until the whole body is in (64 MiB at about 220 KB/s)."""
    max_connections: int = 4096
    """Open HTTP connections per process; beyond it new ones are accepted and closed at once."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> HttpLimits:
        return cls(**json.loads(text))


# httptools as uvicorn's protocol uses it (kiln reaches it through uvicorn, which brings it).
_httptools: Any = httptools_impl.httptools  # type: ignore[attr-defined]  # uvicorn imports it, does not export it
_ParserError: type[Exception] = _httptools.HttpParserError
_ParserUpgrade: type[Exception] = _httptools.HttpParserUpgrade


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a head over the limits."""


_HEAD = ("the request head", "--http-header-timeout-secs")
_BODY = ("the request body", "--http-body-timeout-secs")
_HEAD_TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\n"


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with :class:`HttpLimits` (the ``limits`` class attribute; see
    :func:`protocol_class`). A head over the size or count limit is answered 431, one not complete in time 408,
    and the connection is closed; a body not complete in time closes the connection (the request is then seen
    as disconnected). It also keeps a body chunk that finds nothing waiting as it is (:meth:`on_body`), and sends
    a response's head with its body (:class:`HeadWithBody`)."""

    limits = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_received = 0  # bytes received while a head is incomplete (a bound on its size)
        self._head_bytes = 0  # the head's size as parsed so far
        self._header_count = 0
        self._refusal = ""
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._expire_after(self.limits.header_timeout_s, _HEAD)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal:
            return
        if self._in_head:
            self._head_received += len(data)
        try:
            self._feed(data)
        except _HeadTooLarge:
            self._refuse_head()
            return
        # httptools buffers a header until it ends: a head still incomplete after more bytes than the limit
        # is refused here, before the parser holds any more of it.
        if self._in_head and not self._refusal and self._head_received > self.limits.max_header_bytes:
            self._refusal = f"request head over {self.limits.max_header_bytes} bytes (--http-max-header-size)"
            self._refuse_head()

    def _feed(self, data: bytes) -> None:
        """uvicorn's data_received, except that a head over the limits raises :class:`_HeadTooLarge` (uvicorn
        would log and answer it as an invalid request)."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except _ParserError:
            if self._refusal:
                raise _HeadTooLarge(self._refusal) from None
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
        except _ParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def _refuse_head(self) -> None:
        log.warning("HTTP client %s: %s; answered 431", _peer(self.client), self._refusal)
        self._cancel_deadline()
        self._close_with(_HEAD_TOO_LARGE, self._refusal)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = self._header_count = 0
        if self._deadline is None:  # a keep-alive connection's next request (the first one's runs already)
            self._expire_after(self.limits.header_timeout_s, _HEAD)

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            self._refusal = f"more than {self.limits.max_headers} header fields (--http-max-header-count)"
            raise _HeadTooLarge(self._refusal)
        self._count_head(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_received = 0
        self._cancel_deadline()
        self._expire_after(self.limits.body_timeout_s, _BODY)
        super().on_headers_complete()
        if self.cycle is not None:
            self.cycle.transport = HeadWithBody(self.transport, self.loop)  # type: ignore[assignment]

    def on_message_complete(self) -> None:
        self._cancel_deadline()
        super().on_message_complete()

    def on_body(self, body: bytes) -> None:
        """uvicorn appends every chunk to a bytearray and hands the ASGI app a bytes copy of it: two copies of a
        body that comes in one chunk (an image of a few hundred KB costs tens of microseconds each). A chunk that
        finds nothing waiting is kept as it is instead; ``bytes(chunk)`` in uvicorn's receive is then the chunk
        itself, and later chunks are appended as before."""
        cycle = self.cycle
        if cycle.body or cycle.response_complete or self.parser.should_upgrade():
            super().on_body(body)
            return
        cycle.body = body  # type: ignore[assignment]  # bytes where uvicorn keeps a bytearray: read the same way
        if len(body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.message_event.set()

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self.limits.max_header_bytes:
            self._refusal = f"request head over {self.limits.max_header_bytes} bytes (--http-max-header-size)"
            raise _HeadTooLarge(self._refusal)

    def _expire_after(self, seconds: float, what: tuple[str, str]) -> None:
        self._cancel_deadline()
        if seconds > 0:
            self._deadline = self.loop.call_later(seconds, self._expired, seconds, what)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, seconds: float, what: tuple[str, str]) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        reason = f"{what[0]} did not arrive within {seconds:g} s ({what[1]})"
        log.debug("HTTP client %s: %s; closing the connection", _peer(self.client), reason)
        if self._in_head and (self.cycle is None or self.cycle.response_complete):
            self._close_with(_TIMEOUT, reason)  # nothing else is being answered on this connection
        else:
            self.transport.close()  # the request in progress sees a disconnect

    def _close_with(self, status_line: bytes, reason: str) -> None:
        body = reason.encode("ascii", "replace")
        self.transport.write(status_line + b"content-type: text/plain; charset=utf-8\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
        self.transport.close()


class HeadWithBody:
    """The connection as one request's response cycle writes to it: uvicorn writes a response's status line and
    headers as soon as the app starts the response, and its body in a second write, so each response costs two
    system calls and wakes the client twice. Here the first write waits and leaves together with the next one;
    one that nothing follows in the same event-loop turn (a streamed response's head) leaves at the end of the
    turn. Everything else is the transport's."""

    __slots__ = ("_transport", "_loop", "_held", "_first")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._first = True

    def write(self, data: bytes) -> None:
        if self._first:
            self._first = False
            self._held = data
            self._loop.call_soon(self.flush)
        elif self._held is not None:
            held, self._held = self._held, None
            self._transport.writelines([held, data])
        else:
            self._transport.write(data)

    def flush(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def protocol_class(limits: HttpLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol class uvicorn instantiates per connection, with ``limits``."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"
