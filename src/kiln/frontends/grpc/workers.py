"""``kiln serve --grpc-workers N``: the gRPC frontend in N worker processes sharing the port.

The server process listens on a Unix socket (:mod:`kiln.frontends.grpc.bridge`), starts the workers
(:mod:`kiln.frontends.grpc.worker`), and counts the frontend started once every worker has said it listens. A
worker that dies while the service runs is logged and replaced. Stopping sends SIGTERM, so each worker stops
accepting and lets its calls finish (they still need the server process, which drains after the frontends).
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from kiln.frontends.grpc.bridge import BridgeCore
from kiln.frontends.grpc.server import ReadinessHealth
from kiln.frontends.grpc.servicer import GRPCInferenceService
from kiln.frontends.handoff.supervisor import WorkerPool
from kiln.server.server import Server


class GrpcWorkers:
    """The running workers; ``stop(grace)`` mirrors ``grpc.aio.Server.stop``."""

    def __init__(self, server: Server, address: str, count: int, max_message_bytes: int, grace_s: float) -> None:
        self._address = address
        self._max_message_bytes = max_message_bytes
        self._grace_s = grace_s
        self._pool = WorkerPool("gRPC worker", count, self._spawn)
        self._core = BridgeCore(GRPCInferenceService(server), ReadinessHealth(server), self._pool.hello)
        self._dir = Path(tempfile.mkdtemp(prefix="kiln-grpc-"))
        self._socket = self._dir / "bridge.sock"
        self._unix: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self._unix = await asyncio.get_running_loop().create_unix_server(self._core.connection, str(self._socket))
        await self._pool.start(self._address)

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kiln.frontends.grpc.worker", "--bridge", str(self._socket),
            "--address", self._address, "--max-message-bytes", str(self._max_message_bytes),
            "--grace", str(self._grace_s))

    async def stop(self, grace: float | None = None) -> None:
        await self._pool.stop((grace if grace is not None else self._grace_s) + 5.0)
        if self._unix is not None:
            self._unix.close()
        shutil.rmtree(self._dir, ignore_errors=True)


async def start_grpc_workers(server: Server, host: str, port: int, count: int, *, max_message_bytes: int,
                             grace_s: float) -> tuple[GrpcWorkers, int]:
    """Start ``count`` worker processes serving gRPC on ``host:port`` (port 0 picks a free port first, since
    every worker must bind the same one) and return them with the port."""
    if port == 0:
        port = _free_port(host)
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    workers = GrpcWorkers(server, address, count, max_message_bytes, grace_s)
    await workers.start()
    return workers, port


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
