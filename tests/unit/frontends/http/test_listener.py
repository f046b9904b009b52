"""kiln's HTTP listener: every waiting connection is accepted at once, on uvloop as on asyncio's loop."""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Callable

import pytest

from kiln.frontends.http import listener

WAITING = 40


class _Counting(asyncio.Protocol):
    made: list[asyncio.BaseTransport]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made.append(transport)


def _loops() -> list[Callable[[], asyncio.AbstractEventLoop]]:
    factories: list[Callable[[], asyncio.AbstractEventLoop]] = [asyncio.new_event_loop]
    try:
        import uvloop
    except ImportError:
        return factories
    return [*factories, uvloop.new_event_loop]


@pytest.fixture(params=_loops(), ids=lambda factory: factory.__module__.split(".")[0])
def loop_factory(request: pytest.FixtureRequest) -> Callable[[], asyncio.AbstractEventLoop]:
    factory: Callable[[], asyncio.AbstractEventLoop] = request.param
    return factory


def _connect_waiting(port: int, count: int) -> list[socket.socket]:
    """Connections the kernel has completed but nobody has accepted yet."""
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]


def test_one_readable_event_accepts_every_waiting_connection(
        loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
    made: list[asyncio.BaseTransport] = []
    _Counting.made = made

    async def scenario() -> tuple[int, int]:
        sockets = listener.bind("127.0.0.1", 0, backlog=128)
        server = listener.Listener(sockets, _Counting, None, burst=128)
        clients = _connect_waiting(sockets[0].getsockname()[1], WAITING)
        try:
            taken = server.accept_waiting(sockets[0])  # what one readable event of the socket does
            for _ in range(50):
                if len(made) == WAITING:
                    break
                await asyncio.sleep(0.01)
            return taken, len(made)
        finally:
            server.close()
            await server.wait_closed()
            for transport in made:
                transport.close()
            for client in clients:
                client.close()

    loop = loop_factory()
    try:
        taken, connected = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert (taken, connected) == (WAITING, WAITING)


def test_a_burst_takes_at_most_its_limit_and_the_rest_follow() -> None:
    made: list[asyncio.BaseTransport] = []
    _Counting.made = made

    async def scenario() -> tuple[int, int]:
        sockets = listener.bind("127.0.0.1", 0, backlog=128)
        server = listener.Listener(sockets, _Counting, None, burst=10)
        clients = _connect_waiting(sockets[0].getsockname()[1], 25)
        try:
            first = server.accept_waiting(sockets[0])
            for _ in range(100):  # the loop's reader takes the others
                if len(made) == 25:
                    break
                await asyncio.sleep(0.01)
            return first, len(made)
        finally:
            server.close()
            for transport in made:
                transport.close()
            for client in clients:
                client.close()

    assert asyncio.run(scenario()) == (10, 25)


def test_running_out_of_descriptors_pauses_accepting_instead_of_failing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listener, "RETRY_AFTER_S", 0.05)

    attempts: list[float] = []

    class Exhausted(socket.socket):
        def accept(self) -> tuple[socket.socket, object]:
            attempts.append(asyncio.get_running_loop().time())
            raise OSError(errno.EMFILE, "Too many open files")

    async def scenario() -> int:
        real = listener.bind("127.0.0.1", 0, backlog=8)[0]
        sock = Exhausted(real.family, real.type, fileno=real.detach())
        server = listener.Listener([sock], _Counting, None, burst=8)
        client = socket.create_connection(("127.0.0.1", sock.getsockname()[1]))  # keeps the socket readable
        try:
            taken = server.accept_waiting(sock)
            await asyncio.sleep(0.2)  # the reader comes back after RETRY_AFTER_S and tries again
            return taken
        finally:
            server.close()
            client.close()

    assert asyncio.run(scenario()) == 0
    assert 2 <= len(attempts) <= 6  # paused between attempts, not spinning on the readable socket
    assert attempts[1] - attempts[0] >= 0.04


def test_bind_reports_a_taken_port_and_leaves_nothing_open() -> None:
    first = listener.bind("127.0.0.1", 0, backlog=8)
    port = first[0].getsockname()[1]
    try:
        with pytest.raises(OSError):
            listener.bind("127.0.0.1", port, backlog=8)
    finally:
        for sock in first:
            sock.close()


def test_closing_stops_accepting_and_frees_the_port() -> None:
    async def scenario() -> int:
        sockets = listener.bind("127.0.0.1", 0, backlog=8)
        port = int(sockets[0].getsockname()[1])
        server = listener.Listener(sockets, _Counting, None, burst=8)
        server.close()
        server.close()  # twice is harmless
        await server.wait_closed()
        return port

    port = asyncio.run(scenario())
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1)


def test_a_connection_that_fails_to_set_up_is_closed_and_the_rest_are_accepted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[asyncio.BaseTransport] = []
    _Counting.made = made
    real_setsockopt = socket.socket.setsockopt
    failures: list[int] = []

    def failing_once(sock: socket.socket, *args: object) -> None:
        if args[:2] == (socket.IPPROTO_TCP, socket.TCP_NODELAY) and not failures:
            failures.append(sock.fileno())
            raise OSError(errno.EINVAL, "Invalid argument")
        real_setsockopt(sock, *args)  # type: ignore[call-overload]

    async def scenario() -> tuple[int, int]:
        sockets = listener.bind("127.0.0.1", 0, backlog=16)
        server = listener.Listener(sockets, _Counting, None, burst=16)
        clients = _connect_waiting(sockets[0].getsockname()[1], 5)
        monkeypatch.setattr(socket.socket, "setsockopt", failing_once)
        try:
            taken = server.accept_waiting(sockets[0])
            for _ in range(50):
                if len(made) == 4:
                    break
                await asyncio.sleep(0.01)
            return taken, len(made)
        finally:
            monkeypatch.undo()
            server.close()
            for transport in made:
                transport.close()
            for client in clients:
                client.close()

    assert asyncio.run(scenario()) == (5, 4)
    assert len(failures) == 1


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_an_ipv6_address_is_served_on_ipv6_only() -> None:
    made: list[asyncio.BaseTransport] = []
    _Counting.made = made

    async def scenario() -> tuple[int, int]:
        sockets = listener.bind("::1", 0, backlog=8)
        server = listener.Listener(sockets, _Counting, None, burst=8)
        port = sockets[0].getsockname()[1]
        client = socket.create_connection(("::1", port))
        try:
            taken = server.accept_waiting(sockets[0])
            await asyncio.sleep(0.05)
            return taken, sockets[0].getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
        finally:
            server.close()
            for transport in made:
                transport.close()
            client.close()

    assert asyncio.run(scenario()) == (1, 1)
