"""HTTP workers sharing one listening socket deal new connections out by the counts in their shares: the worker
holding the fewest takes the next one, a dead worker's slot is ignored, and a worker that never takes its turn
holds nobody up for more than a few milliseconds. Real sockets and real listeners, several in one event loop as
several worker processes would run them."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest

from kiln.frontends.http import listener
from kiln.frontends.http.shares import ABSENT, ConnectionShares


class _Worker:
    """One worker's listener on the shared socket (its own descriptor of it, as a worker process inherits one), with
    the set of open connections uvicorn would keep."""

    def __init__(self, sockets: list[socket.socket], shares: ConnectionShares) -> None:
        sockets = [sock.dup() for sock in sockets]
        self.connections = listener.CountedConnections(lambda: self.listener.publish())
        self.transports: list[asyncio.BaseTransport] = []
        worker = self

        class Protocol(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                worker.connections.add(self)
                worker.transports.append(transport)

            def connection_lost(self, exc: Exception | None) -> None:
                worker.connections.discard(self)

        self.listener = listener.Listener(sockets, Protocol, None, burst=128,
                                          open_connections=lambda: len(self.connections), shares=shares)

    async def close(self) -> None:
        self.listener.close()
        await self.listener.wait_closed()
        for transport in self.transports:
            transport.close()


def _shares(workers: int) -> list[ConnectionShares]:
    """The shares as the server process makes them and as each of ``workers`` workers maps them."""
    made = ConnectionShares.create(workers)
    assert made is not None, "memfd_create is there on Linux"
    server, fd = made
    try:
        return [ConnectionShares.inherited(os.dup(fd), index) for index in range(workers)]
    finally:
        os.close(fd)
        server.close()


async def _until(condition: object, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:  # type: ignore[operator]
        await asyncio.sleep(0.005)


class _Port:
    """A listening socket shared by ``listening`` workers out of ``slots`` (the others never accept), with the
    clients connected to it; everything is closed on exit."""

    def __init__(self, slots: int, listening: int) -> None:
        self.sockets = listener.bind("127.0.0.1", 0, backlog=128)
        self.shares = _shares(slots)
        self.workers = [_Worker(self.sockets, share) for share in self.shares[:listening]]
        self.clients: list[socket.socket] = []

    def connect(self, count: int) -> None:
        """Connections the kernel completes at once, waiting for a worker to accept them."""
        port = self.sockets[0].getsockname()[1]
        self.clients += [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]

    def held(self) -> list[int]:
        return [len(worker.connections) for worker in self.workers]

    async def __aenter__(self) -> _Port:
        return self

    async def __aexit__(self, *_: object) -> None:
        for worker in self.workers:
            await worker.close()
        for sock in [*self.clients, *self.sockets]:
            sock.close()


def test_a_burst_is_dealt_out_to_the_workers_holding_the_fewest() -> None:
    async def scenario() -> tuple[list[int], list[int], list[int]]:
        async with _Port(3, 3) as port:
            port.connect(7)  # all waiting before any worker looks
            await _until(lambda: sum(port.held()) == 7)
            first, published = port.held(), port.shares[0].counts()
            port.connect(2)  # the two holding 2 take one each
            await _until(lambda: sum(port.held()) == 9)
            return first, published, port.held()

    first, published, then = asyncio.run(scenario())
    assert sorted(first) == [2, 2, 3] and published == first and then == [3, 3, 3], (first, published, then)


def test_connections_arriving_one_at_a_time_are_dealt_out_too() -> None:
    """As a client opens its pool one connection at a time (perf_analyzer's came so on an H100 host): each is alone
    when it comes, so a worker holding more leaves it to another, and that must not count as waiting for the next
    one, which comes long after."""

    async def scenario() -> list[int]:
        async with _Port(4, 4) as port:
            for count in range(1, 17):
                port.connect(1)
                await _until(lambda count=count: sum(port.held()) == count)
                await asyncio.sleep(2 * listener.MAX_DEFER_S)
            return port.held()

    held = asyncio.run(scenario())
    assert held == [4, 4, 4, 4], held


def test_closed_connections_are_counted_off() -> None:
    async def scenario() -> tuple[list[int], list[int]]:
        async with _Port(2, 2) as port:
            port.connect(4)
            await _until(lambda: sum(port.held()) == 4)
            for transport in port.workers[0].transports:
                transport.close()
            await _until(lambda: port.held()[0] == 0)
            after_close = port.shares[0].counts()
            port.connect(2)  # both go to the worker that holds none
            await _until(lambda: sum(port.held()) == 4)
            return after_close, port.held()

    after_close, counts = asyncio.run(scenario())
    assert after_close == [0, 2] and counts == [2, 2], (after_close, counts)


@pytest.mark.parametrize("other", ["absent", "stuck"])
def test_a_dead_or_stuck_worker_holds_nobody_up(other: str) -> None:
    """Worker 1 never accepts: marked absent (its process is gone), or still claiming no connections (stuck)."""

    async def scenario() -> tuple[int, float]:
        async with _Port(2, 1) as port:
            if other == "stuck":
                port.shares[1].publish(0)
            started = time.monotonic()
            port.connect(3)
            await _until(lambda: port.held() == [3])
            return port.held()[0], time.monotonic() - started

    taken, seconds = asyncio.run(scenario())
    assert taken == 3
    if other == "stuck":  # the second and third each waited for their turn to pass to the stuck worker
        assert seconds >= 2 * listener.MAX_DEFER_S
    assert seconds < 1.0


def test_a_worker_that_stops_accepting_leaves_its_slot_absent() -> None:
    async def scenario() -> tuple[list[int], list[int]]:
        async with _Port(2, 2) as port:
            port.connect(2)
            await _until(lambda: sum(port.held()) == 2)
            port.workers[0].listener.close()  # draining: its connections may still close
            for transport in port.workers[0].transports:
                transport.close()
            await _until(lambda: port.held()[0] == 0)
            drained = port.shares[1].counts()
            port.connect(2)  # for the worker still listening
            await _until(lambda: port.held()[1] == 3)
            return drained, port.held()

    drained, counts = asyncio.run(scenario())
    assert drained == [ABSENT, 1] and counts == [0, 3], (drained, counts)


def test_the_server_process_marks_every_slot_absent_until_its_worker_listens() -> None:
    made = ConnectionShares.create(3)
    assert made is not None
    server, fd = made
    worker = ConnectionShares.inherited(fd, 1)
    assert server.counts() == [ABSENT] * 3 and server.fewest() == 0
    worker.publish(5)
    assert server.counts() == [ABSENT, 5, ABSENT] and server.fewest() == 5
    server.mark_absent(1)  # its process died; the replacement publishes when it listens
    assert worker.counts() == [ABSENT] * 3
    worker.close()
    server.close()
