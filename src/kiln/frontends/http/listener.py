"""Accepting HTTP connections in bursts, not one per event-loop turn.

uvloop (libuv 1.45 and later) accepts one connection each time round the event loop. While the loop is busy serving,
a turn takes milliseconds, so a burst of new connections (a load balancer filling its pool, clients reconnecting
after a restart) waits in the kernel's accept queue for seconds while the connections accepted first are served:
with four models and 256 new connections each, two models' clients got 16 requests/s while the other two got 800
and 2,600. kiln's frontends therefore accept every waiting connection (up to the backlog) each time the listening
socket is readable, as asyncio's own loop does, and hand each one to uvicorn's protocol.

HTTP workers share one listening socket, and each accepts only while no other live worker holds fewer connections
(shares.py): a burst is dealt out, not taken whole by the first worker to wake. A worker holding more leaves a
waiting connection to the others and looks again every ``RECHECK_S``; once it has waited ``MAX_DEFER_S`` (the workers
holding fewer are busy or stuck), it takes it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import select
import socket
import ssl
from collections.abc import Callable
from typing import Any

from kiln.frontends.http.shares import ConnectionShares

log = logging.getLogger("kiln.http")

RETRY_AFTER_S = 1.0  # out of file descriptors: stop accepting this long, as asyncio does
FULL_LOG_INTERVAL_S = 10.0  # at the connection limit: one warning this often
RECHECK_S = 0.001  # a worker holding more than another looks at a waiting connection again after this long
MAX_DEFER_S = 0.005  # and takes it once it has waited this long
_RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

ProtocolFactory = Callable[[], asyncio.Protocol]


def bind(host: str | None, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets for ``host`` (every address it resolves to; None or '' for all interfaces) and ``port``."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _name, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # its IPv4 twin binds separately
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class Listener:
    """Accepts on ``sockets`` for as long as it is open; shaped like the asyncio server uvicorn keeps in its
    ``servers`` list (``sockets``, ``close()``, ``wait_closed()``)."""

    def __init__(self, sockets: list[socket.socket], factory: ProtocolFactory, tls: ssl.SSLContext | None,
                 burst: int, *, max_connections: int | None = None,
                 open_connections: Callable[[], int] = lambda: 0, shares: ConnectionShares | None = None) -> None:
        self.sockets = sockets
        self._max_connections = max_connections
        self._open_connections = open_connections
        self._shares = shares
        self._deferred_since: float | None = None  # when this worker first left a waiting connection to others
        self._refused_logged_at = -FULL_LOG_INTERVAL_S
        self._factory = factory
        self._tls = tls
        self._burst = max(1, burst)
        self._loop = asyncio.get_running_loop()
        self._starting: set[asyncio.Task[object]] = set()
        self._closed = False
        self.publish()  # this worker listens: its slot counts from now on
        for sock in sockets:
            self._loop.add_reader(sock.fileno(), self.accept_waiting, sock)

    def publish(self) -> None:
        """Write this worker's count of connections into its slot of the shares; called on every change of it."""
        if self._shares is not None and not self._closed:
            self._shares.publish(self._held())

    def _held(self) -> int:
        """This worker's connections, those starting included."""
        return self._open_connections() + len(self._starting)

    def accept_waiting(self, sock: socket.socket) -> int:
        """Accept the connections waiting on ``sock`` (at most ``burst``, and while this worker holds no more
        than any other); returns how many were taken."""
        for taken in range(self._burst):
            if not self._turn(sock):
                return taken
            try:
                connection, _address = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                self._deferred_since = None  # nothing waits (any more)
                return taken
            except OSError as exc:
                if exc.errno not in _RESOURCE_ERRORS:
                    raise
                log.error("not accepting connections for %.0f s: %s", RETRY_AFTER_S, exc)
                self._loop.remove_reader(sock.fileno())
                self._loop.call_later(RETRY_AFTER_S, self._resume, sock)
                return taken
            self._deferred_since = None
            if self._full():
                connection.close()  # at once, rather than left waiting in the kernel's queue
            else:
                self._start(connection)
                self.publish()
        return self._burst

    def _turn(self, sock: socket.socket) -> bool:
        """Whether this worker takes the next waiting connection: it holds no more than the live worker holding
        the fewest, or a connection has waited ``MAX_DEFER_S`` for another. Otherwise it stops watching ``sock``
        for ``RECHECK_S``."""
        if self._shares is None or self._held() <= self._shares.fewest():  # its own slot is current (publish)
            return True
        now = self._loop.time()
        if self._deferred_since is None:
            self._deferred_since = now
        elif now - self._deferred_since >= MAX_DEFER_S:
            return True
        self._loop.remove_reader(sock.fileno())
        self._loop.call_later(RECHECK_S, self._resume, sock)
        return False

    def _full(self) -> bool:
        """Whether the process has its maximum of open connections (those starting count too)."""
        if self._max_connections is None:
            return False
        if self._held() < self._max_connections:
            return False
        now = self._loop.time()
        if now - self._refused_logged_at >= FULL_LOG_INTERVAL_S:
            self._refused_logged_at = now
            log.warning("%d HTTP connections open (--http-max-connections): closing new ones until some end",
                        self._max_connections)
        return True

    def close(self) -> None:
        """Stop accepting; connections already made are uvicorn's to shut down."""
        if self._closed:
            return
        self._closed = True
        if self._shares is not None:  # draining: the others must not wait for this worker to take connections
            self._shares.withdraw()
        for sock in self.sockets:
            self._loop.remove_reader(sock.fileno())
            sock.close()

    async def wait_closed(self) -> None:
        if self._starting:
            await asyncio.gather(*self._starting, return_exceptions=True)

    def _start(self, connection: socket.socket) -> None:
        try:
            connection.setblocking(False)
            if connection.family in (socket.AF_INET, socket.AF_INET6):
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # responses leave when written
        except OSError:  # the client already hung up; the connections behind it still get accepted
            connection.close()
            return
        task: asyncio.Task[object] = self._loop.create_task(
            self._loop.connect_accepted_socket(self._factory, connection, ssl=self._tls))
        self._starting.add(task)
        task.add_done_callback(self._started)

    def _started(self, task: asyncio.Task[object]) -> None:
        self._starting.discard(task)
        self.publish()  # counted among the open connections now, or gone
        if not task.cancelled() and task.exception() is not None:
            # A client that failed its TLS handshake or hung up at once: nothing to serve.
            log.debug("connection not started: %s", task.exception())

    def _resume(self, sock: socket.socket) -> None:
        if self._closed:
            return
        if self._deferred_since is not None and not _waiting(sock):
            # Another worker took the connection this one left: the next to come, maybe much later, is a new wait.
            # Kept, the old start would let this worker take it at once (a client opening its pool connection by
            # connection gave one worker all 16).
            self._deferred_since = None
        self._loop.add_reader(sock.fileno(), self.accept_waiting, sock)


def _waiting(sock: socket.socket) -> bool:
    """Whether a connection waits to be accepted on ``sock``."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class CountedConnections(set[Any]):
    """uvicorn's set of a server's open connections (``ServerState.connections``) that calls ``changed`` after
    each connection is added or discarded: how a worker keeps its count in the shares current."""

    def __init__(self, changed: Callable[[], None]) -> None:
        super().__init__()
        self._changed = changed

    def add(self, item: Any) -> None:
        super().add(item)
        self._changed()

    def discard(self, item: Any) -> None:
        super().discard(item)
        self._changed()
