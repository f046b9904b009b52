"""A response's head leaves with its body (limits.HeadWithBody): one system call instead of two, counted by the
kernel (/proc/self/io) on uvloop's TCP transport, as `kiln serve` runs it; a head that nothing follows leaves at
the end of the turn, and closing sends what is held first."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvloop

from kiln.frontends.http.limits import HeadWithBody

IO = Path("/proc/self/io")
pytestmark = pytest.mark.skipif(not IO.exists(), reason="counts system calls through /proc/self/io (Linux)")

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"


@dataclass
class Connection:
    transport: asyncio.Transport
    client: socket.socket

    def received(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.client.recv(size - len(data))
            if not chunk:
                break
            data += chunk
        return data


def on_uvloop(test: Callable[[Connection], Awaitable[None]]) -> None:
    """Run ``test`` on a connection served by uvloop (whose writes are write(2)/writev(2), which the kernel
    counts in syscw; asyncio's own send(2) is not counted there)."""
    async def run() -> None:
        loop = asyncio.get_running_loop()
        made: asyncio.Future[asyncio.Transport] = loop.create_future()

        class Server(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                made.set_result(transport)  # type: ignore[arg-type]

        server = await loop.create_server(Server, "127.0.0.1", 0)
        client = socket.create_connection(server.sockets[0].getsockname()[:2])
        try:
            client.settimeout(5)
            transport = await asyncio.wait_for(made, 5)
            try:
                await test(Connection(transport, client))
            finally:
                transport.close()
        finally:
            client.close()
            server.close()

    uvloop.run(run())


def _writes() -> int:
    """System calls that wrote, made by this process so far."""
    for line in IO.read_text().splitlines():
        name, _, value = line.partition(":")
        if name == "syscw":
            return int(value)
    raise AssertionError("no syscw in /proc/self/io")


def test_a_head_and_its_body_leave_in_one_system_call() -> None:
    on_uvloop(_a_head_and_its_body_leave_in_one_system_call)


async def _a_head_and_its_body_leave_in_one_system_call(connection: Connection) -> None:
    held = HeadWithBody(connection.transport, asyncio.get_running_loop())
    before = _writes()
    held.write(HEAD)
    held.write(b"hello")
    after = _writes()
    assert after - before == 1
    assert connection.received(len(HEAD) + 5) == HEAD + b"hello"


def test_a_head_that_nothing_follows_leaves_at_the_end_of_the_turn() -> None:
    on_uvloop(_a_head_that_nothing_follows_leaves_at_the_end_of_the_turn)


async def _a_head_that_nothing_follows_leaves_at_the_end_of_the_turn(connection: Connection) -> None:
    held = HeadWithBody(connection.transport, asyncio.get_running_loop())
    before = _writes()
    held.write(HEAD)
    assert _writes() == before  # held for now
    await asyncio.sleep(0)
    assert connection.received(len(HEAD)) == HEAD
    held.write(b"hel")  # later writes go out at once, in order
    held.write(b"lo")
    assert connection.received(5) == b"hello"


def test_closing_sends_the_held_head_first() -> None:
    on_uvloop(_closing_sends_the_held_head_first)


async def _closing_sends_the_held_head_first(connection: Connection) -> None:
    held = HeadWithBody(connection.transport, asyncio.get_running_loop())
    held.write(HEAD)
    held.close()
    await asyncio.sleep(0.01)  # the transport closes once its buffer is written
    assert connection.received(len(HEAD) + 1) == HEAD  # then the end of the stream
    assert held.is_closing()  # everything else is the transport's
