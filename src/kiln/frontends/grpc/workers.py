"""``kiln serve --grpc-workers N``: the gRPC frontend in N worker processes sharing the port.

The server process starts the workers (:mod:`kiln.frontends.grpc.worker`), each with its link (a socket pair, see
:mod:`kiln.frontends.grpc.bridge`) and two shared-memory arenas for ModelInfer's tensors, and counts the frontend
started once every worker has said it listens. A worker that dies while the service runs is logged and replaced.
Stopping sends SIGTERM, so each worker stops accepting and lets its calls finish (they still need the server
process, which drains after the frontends).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys

from kiln.frontends.access import AccessPolicy, worker_environment
from kiln.frontends.grpc.access import GrpcTls
from kiln.frontends.grpc.bridge import BridgeCore
from kiln.frontends.grpc.server import GrpcConnectionLimits, ReadinessHealth
from kiln.frontends.grpc.servicer import GRPCInferenceService
from kiln.frontends.handoff.arena import ARENA_BYTES, Arena, create_arena_file
from kiln.frontends.handoff.calls import join_hold
from kiln.frontends.handoff.supervisor import WorkerPool
from kiln.server.server import Server


class GrpcWorkers:
    """The running workers; ``stop(grace)`` mirrors ``grpc.aio.Server.stop``."""

    def __init__(self, server: Server, address: str, count: int, max_message_bytes: int, grace_s: float,
                 arena_bytes: int = ARENA_BYTES, access: AccessPolicy | None = None,
                 tls: GrpcTls | None = None, limits: GrpcConnectionLimits | None = None) -> None:
        self._address = address
        self._access = access
        self._tls = tls
        self._limits = limits or GrpcConnectionLimits()
        self._max_message_bytes = max_message_bytes
        self._grace_s = grace_s
        self._arena_bytes = arena_bytes
        self.pool = WorkerPool("gRPC worker", count, self._spawn)
        self._core = BridgeCore(server, GRPCInferenceService(server), ReadinessHealth(server), self.pool.hello)

    async def start(self) -> None:
        join_hold()  # a bad KILN_JOIN_HOLD stops kiln serve here, not each worker as it starts
        await self.pool.start(self._address)

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        """One worker with its link (one end of a socket pair) and its two arenas, passed down as inherited
        descriptors: nothing is named in the file system."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        arena_fds = [create_arena_file(self._arena_bytes), create_arena_file(self._arena_bytes)]
        request_arena, response_arena = (Arena.from_fd(fd) if fd is not None else None for fd in arena_fds)
        protocol = self._core.connection(request_arena, response_arena)
        await asyncio.get_running_loop().create_unix_connection(lambda: protocol, sock=ours)
        request_fd, response_fd = (-1 if fd is None else fd for fd in arena_fds)
        try:
            return await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kiln.frontends.grpc.worker", "--link-fd", str(theirs.fileno()),
                "--request-arena-fd", str(request_fd), "--response-arena-fd", str(response_fd),
                "--address", self._address, "--max-message-bytes", str(self._max_message_bytes),
                "--grace", str(self._grace_s), *(self._tls.worker_args() if self._tls is not None else ()),
                "--keepalive-secs", str(self._limits.keepalive_s),
                "--max-connection-idle-secs", str(self._limits.max_connection_idle_s),
                pass_fds=[theirs.fileno(), *(fd for fd in arena_fds if fd is not None)],
                env=worker_environment(self._access))
        finally:
            theirs.close()  # the child has its copies; the mappings stay in this process
            for fd in arena_fds:
                if fd is not None:
                    os.close(fd)

    async def stop(self, grace: float | None = None) -> None:
        await self.pool.stop((grace if grace is not None else self._grace_s) + 5.0)


async def start_grpc_workers(server: Server, host: str, port: int, count: int, *, max_message_bytes: int,
                             grace_s: float, arena_bytes: int = ARENA_BYTES, access: AccessPolicy | None = None,
                             tls: GrpcTls | None = None,
                             limits: GrpcConnectionLimits | None = None) -> tuple[GrpcWorkers, int]:
    """Start ``count`` worker processes serving gRPC on ``host:port`` (port 0 picks a free port first, since
    every worker must bind the same one) and return them with the port; ``access`` and ``tls`` as the in-process
    server takes them (server.py)."""
    if port == 0:
        port = _free_port(host)
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    workers = GrpcWorkers(server, address, count, max_message_bytes, grace_s, arena_bytes, access, tls, limits)
    await workers.start()
    return workers, port


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
