"""Frames over one Unix connection between a worker process and the server process.

A frame is a 13-byte header (payload bytes, call id, kind) and its payload. Calls are matched to their answers by
call id; call 0 carries messages about the link itself (hello, slot releases). Call ids are 64-bit: a worker counts
them up from 1 for as long as it runs (32 bits would run out after days at tens of thousands of requests a second).
"""

from __future__ import annotations

import asyncio
import collections
import struct
from collections.abc import Callable
from typing import cast

HEADER = struct.Struct("<IQB")  # payload bytes, call id, kind

# worker -> server process
HELLO = 1  # the worker listens
INFER = 2  # a decoded infer request: descriptor (tensors.py)
FORWARD = 3  # any other request, whole: scope document and body
ACK = 4  # a streamed response chunk reached the client: the server may send one more
DISCONNECT = 5  # the client of a forwarded request went away
INFER_JOINED = 6  # several requests joined into one (kiln.v2.joined); its members have consecutive call ids
# server process -> worker
ANSWER = 10  # an infer answer: descriptor
ERROR = 11  # an infer request failed: error code and message
START = 12  # a forwarded request's response status and headers
BODY = 13  # a chunk of its body, more follow
BODY_END = 14  # its last chunk
JOINED_ANSWER = 15  # an answer to a run of a joined request's members, on the first one's call id
# both ways, call 0: offsets of arena slots the receiver may reuse
RELEASE = 20

FLUSH_DELAY_S = 0.002  # how long released slots wait for a frame to ride along with

# Called with the header's fields after the payload size (here call id and kind), then the payload.
FrameHandler = Callable[..., None]


def frame(call: int, kind: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), call, kind) + payload


def pack_offsets(offsets: list[int]) -> bytes:
    return struct.pack(f"<{len(offsets)}Q", *offsets)


def unpack_offsets(payload: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(payload) // 8}Q", payload)


class FrameProtocol(asyncio.Protocol):
    """Frames in and out of one Unix connection. A protocol rather than stream reads: at thousands of requests
    per second the per-read cost of ``StreamReader.readexactly`` shows. ``header`` starts with the payload size;
    the gRPC bridge's frames carry one more field (the method index)."""

    def __init__(self, on_frame: FrameHandler, header: struct.Struct = HEADER) -> None:
        self._on_frame = on_frame
        self._header = header
        self._buffer = bytearray()
        self._outgoing: list[bytes] = []
        self._corked = False
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        header = self._header
        start = 0
        end = len(buffer)
        while end - start >= header.size:
            size, *fields = header.unpack_from(buffer, start)
            stop = start + header.size + size
            if stop > end:
                break
            self._on_frame(*fields, bytes(buffer[start + header.size:stop]))
            start = stop
        del buffer[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def send(self, data: bytes) -> None:
        """The first frame of an event-loop turn leaves at once; those that follow in the same turn (the rest of a
        batch's answers, of a burst's requests) leave together after it: each write is a system call that wakes
        the peer."""
        if self._corked:
            self._outgoing.append(data)
            return
        self._corked = True
        asyncio.get_running_loop().call_soon(self._uncork)
        self._write(data)

    def _uncork(self) -> None:
        self._corked = False
        if self._outgoing:
            data = b"".join(self._outgoing)
            self._outgoing.clear()
            self._write(data)

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)


class Releases:
    """Slot offsets to hand back to the peer. They ride along with the next frame that goes out anyway
    (``take``), or leave on their own ``FLUSH_DELAY_S`` after the first was added. ``add`` may be called from any
    thread (the last numpy view of an input can die on an engine's thread). ``release_frame`` frames a RELEASE
    payload where the link's header is not this module's (the gRPC bridge's)."""

    def __init__(self, protocol: FrameProtocol, release_frame: Callable[[bytes], bytes] | None = None) -> None:
        self._protocol = protocol
        self._release_frame = release_frame or (lambda payload: frame(0, RELEASE, payload))
        self._loop = asyncio.get_running_loop()
        self._pending: collections.deque[int] = collections.deque()  # append and popleft are thread-safe
        self._scheduled = False

    def add(self, offset: int) -> None:
        self._pending.append(offset)
        if not self._scheduled:
            self._scheduled = True
            try:
                running = asyncio.get_running_loop() is self._loop
            except RuntimeError:
                running = False
            if running:
                self._loop.call_later(FLUSH_DELAY_S, self._flush)
            elif not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._loop.call_later, FLUSH_DELAY_S, self._flush)

    def take(self) -> bytes:
        """A RELEASE frame of the offsets pending (empty when none are), to send before another frame."""
        pending = []
        while self._pending:
            pending.append(self._pending.popleft())
        return self._release_frame(pack_offsets(pending)) if pending else b""

    def _flush(self) -> None:
        self._scheduled = False  # before draining: an offset added from now on schedules another flush
        data = self.take()
        if data:
            self._protocol.send(data)
