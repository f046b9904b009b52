"""``kiln serve --http-workers N``: the HTTP frontend in N worker processes, tensors handed over in shared memory.

The server process binds the port once and every worker accepts from that socket, each while no other holds fewer
connections (the counts are in shared memory: shares.py), so connections spread by load rather than by the kernel's
hash; the server process keeps the socket, so the connections waiting when a worker dies go to the others. For each
worker it makes a socket pair (the link) and two arenas, and passes all of them down as inherited descriptors:
nothing is named in the file system. Workers decode infer requests themselves (worker_app.py) and the server
process answers them (core.py); see docs/serving.md, "HTTP workers".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from starlette.types import ASGIApp

from kiln.frontends.access import AccessPolicy, worker_environment
from kiln.frontends.handoff.arena import ARENA_BYTES, Arena, create_arena_file
from kiln.frontends.handoff.calls import join_hold
from kiln.frontends.handoff.supervisor import WorkerPool
from kiln.frontends.http import listener
from kiln.frontends.http.core import CoreLink
from kiln.frontends.http.limits import HttpLimits
from kiln.frontends.http.shares import ConnectionShares
from kiln.server.server import Server

log = logging.getLogger("kiln.http.workers")

BACKLOG = 2048


@dataclass(frozen=True)
class WorkerSettings:
    host: str
    port: int
    count: int
    max_input_size: int
    grace_s: float
    certfile: Path | None = None
    keyfile: Path | None = None
    client_ca: Path | None = None
    arena_bytes: int = ARENA_BYTES
    log_level: str = "INFO"
    access: AccessPolicy | None = None  # --http-restricted-api, handed down in the environment
    limits: HttpLimits = HttpLimits()


class HttpWorkers:
    """The running workers; ``stop(grace)`` drains them, as the gRPC workers' does."""

    def __init__(self, server: Server, app: ASGIApp, settings: WorkerSettings) -> None:
        self._server = server
        self._app = app
        self.settings = settings
        self._sockets: list[socket.socket] = []
        self._shares: tuple[ConnectionShares, int] | None = None  # with the descriptor each worker inherits
        self.pool = WorkerPool("HTTP worker", settings.count, self._spawn)

    async def start(self) -> int:
        """Bind, start the workers, return the port once every worker listens."""
        join_hold()  # a bad KILN_JOIN_HOLD stops kiln serve here, not each worker as it starts
        settings = self.settings
        self._sockets = listener.bind(settings.host, settings.port, BACKLOG)
        port = int(self._sockets[0].getsockname()[1])
        self._shares = ConnectionShares.create(settings.count)
        try:
            await self.pool.start(f"{settings.host}:{port}")
        except OSError:
            self._close_sockets()
            raise
        return port

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        settings = self.settings
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        arena_fds = [create_arena_file(settings.arena_bytes), create_arena_file(settings.arena_bytes)]
        request_arena, response_arena = (Arena.from_fd(fd) if fd is not None else None for fd in arena_fds)
        link = CoreLink(self._server, self._app, request_arena, response_arena, self.pool.hello)
        await asyncio.get_running_loop().create_unix_connection(lambda: link.protocol, sock=ours)
        listen_fds = [s.fileno() for s in self._sockets]
        request_fd, response_fd = (-1 if fd is None else fd for fd in arena_fds)
        shares_fd = -1
        if self._shares is not None:
            shares, shares_fd = self._shares
            shares.mark_absent(index)  # a dead predecessor's count must not hold the others back
        command = [sys.executable, "-m", "kiln.frontends.http.worker", "--link-fd", str(theirs.fileno()),
                   "--listen-fds", ",".join(map(str, listen_fds)), "--shares-fd", str(shares_fd),
                   "--shares-index", str(index), "--request-arena-fd", str(request_fd),
                   "--response-arena-fd", str(response_fd), "--max-input-size", str(settings.max_input_size),
                   "--grace", str(settings.grace_s), "--log-level", settings.log_level,
                   "--limits", settings.limits.to_json()]
        for name, path in (("--certfile", settings.certfile), ("--keyfile", settings.keyfile),
                           ("--client-ca", settings.client_ca)):
            if path is not None:
                command += [name, str(path)]
        passed = [theirs.fileno(), *listen_fds, *(fd for fd in (*arena_fds, shares_fd) if fd is not None and fd >= 0)]
        try:
            return await asyncio.create_subprocess_exec(*command, pass_fds=passed,
                                                        env=worker_environment(settings.access))
        finally:
            theirs.close()  # the child has its copies; the mappings stay in this process
            for fd in arena_fds:
                if fd is not None:
                    os.close(fd)

    def connections(self) -> list[int | None]:
        """Each worker's open connections as it last published them (None: not listening, or no shares here)."""
        if self._shares is None:
            return [None] * self.settings.count
        return [None if count < 0 else count for count in self._shares[0].counts()]

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting here, SIGTERM the workers, and wait for them to drain (then kill what is left)."""
        self._close_sockets()
        await self.pool.stop((grace if grace is not None else self.settings.grace_s) + 5.0)

    def _close_sockets(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()
        if self._shares is not None:
            shares, fd = self._shares
            self._shares = None
            shares.close()
            os.close(fd)
