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


def _connect(port: int, count: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]


def test_a_burst_is_dealt_out_to_the_workers_holding_the_fewest() -> None:
    async def scenario() -> list[int]:
        sockets = listener.bind("127.0.0.1", 0, backlog=128)
        shares = _shares(3)
        workers = [_Worker(sockets, share) for share in shares]
        clients = _connect(sockets[0].getsockname()[1], 7)  # all waiting before any worker looks
        try:
            await _until(lambda: sum(len(w.connections) for w in workers) == 7)
            counts = [len(w.connections) for w in workers]
            assert shares[0].counts() == counts  # every worker's slot says what it holds
            more = _connect(sockets[0].getsockname()[1], 2)  # the two holding 2 take one each
            clients += more
            await _until(lambda: sum(len(w.connections) for w in workers) == 9)
            return counts + [len(w.connections) for w in workers]
        finally:
            for worker in workers:
                await worker.close()
            for sock in [*clients, *sockets]:
                sock.close()

    counts = asyncio.run(scenario())
    assert sorted(counts[:3]) == [2, 2, 3] and counts[3:] == [3, 3, 3], counts


def test_closed_connections_are_counted_off() -> None:
    async def scenario() -> tuple[list[int], list[int]]:
        sockets = listener.bind("127.0.0.1", 0, backlog=128)
        shares = _shares(2)
        workers = [_Worker(sockets, share) for share in shares]
        clients = _connect(sockets[0].getsockname()[1], 4)
        try:
            await _until(lambda: sum(len(w.connections) for w in workers) == 4)
            for transport in workers[0].transports:
                transport.close()
            await _until(lambda: not workers[0].connections)
            after_close = shares[0].counts()
            clients += _connect(sockets[0].getsockname()[1], 2)  # both go to the worker that holds none
            await _until(lambda: sum(len(w.connections) for w in workers) == 4)
            return after_close, [len(w.connections) for w in workers]
        finally:
            for worker in workers:
                await worker.close()
            for sock in [*clients, *sockets]:
                sock.close()

    after_close, counts = asyncio.run(scenario())
    assert after_close == [0, 2] and counts == [2, 2], (after_close, counts)


@pytest.mark.parametrize("other", ["absent", "stuck"])
def test_a_dead_or_stuck_worker_holds_nobody_up(other: str) -> None:
    """Worker 1 never accepts: marked absent (its process is gone), or still claiming no connections (stuck)."""

    async def scenario() -> tuple[int, float]:
        sockets = listener.bind("127.0.0.1", 0, backlog=128)
        shares = _shares(2)
        if other == "stuck":
            shares[1].publish(0)
        worker = _Worker(sockets, shares[0])
        started = time.monotonic()
        clients = _connect(sockets[0].getsockname()[1], 3)
        try:
            await _until(lambda: len(worker.connections) == 3)
            return len(worker.connections), time.monotonic() - started
        finally:
            await worker.close()
            for sock in [*clients, *sockets]:
                sock.close()

    taken, seconds = asyncio.run(scenario())
    assert taken == 3
    if other == "stuck":  # the second and third each waited for their turn to pass to the stuck worker
        assert seconds >= 2 * listener.MAX_DEFER_S
    assert seconds < 1.0


def test_a_worker_that_stops_accepting_leaves_its_slot_absent() -> None:
    async def scenario() -> tuple[list[int], list[int]]:
        sockets = listener.bind("127.0.0.1", 0, backlog=128)
        shares = _shares(2)
        workers = [_Worker(sockets, share) for share in shares]
        clients = _connect(sockets[0].getsockname()[1], 2)
        try:
            await _until(lambda: sum(len(w.connections) for w in workers) == 2)
            workers[0].listener.close()  # draining: its connections may still close
            for transport in workers[0].transports:
                transport.close()
            await _until(lambda: not workers[0].connections)
            drained = shares[1].counts()
            clients += _connect(sockets[0].getsockname()[1], 2)  # for the worker still listening
            await _until(lambda: len(workers[1].connections) == 3)
            return drained, [len(w.connections) for w in workers]
        finally:
            for worker in workers:
                await worker.close()
            for sock in [*clients, *sockets]:
                sock.close()

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
