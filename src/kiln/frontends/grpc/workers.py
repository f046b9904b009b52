"""``kiln serve --grpc-workers N``: the gRPC frontend in N worker processes sharing the port.

The server process listens on a Unix socket (:mod:`kiln.frontends.grpc.bridge`), starts the workers
(:mod:`kiln.frontends.grpc.worker`), and counts the frontend started once every worker has said it listens. A
worker that dies while the service runs is logged and replaced. Stopping sends SIGTERM, so each worker stops
accepting and lets its calls finish (they still need the server process, which drains after the frontends).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path

from kiln.frontends.grpc.bridge import BridgeCore
from kiln.frontends.grpc.server import ReadinessHealth
from kiln.frontends.grpc.servicer import GRPCInferenceService
from kiln.server.server import Server

log = logging.getLogger("kiln.grpc.workers")

START_TIMEOUT_S = 60.0
RESTART_DELAY_S = 0.5


class GrpcWorkers:
    """The running workers; ``stop(grace)`` mirrors ``grpc.aio.Server.stop``."""

    def __init__(self, server: Server, address: str, count: int, max_message_bytes: int, grace_s: float) -> None:
        self._address = address
        self._count = count
        self._max_message_bytes = max_message_bytes
        self._grace_s = grace_s
        self._hellos = 0
        self._all_listening = asyncio.Event()
        self._core = BridgeCore(GRPCInferenceService(server), ReadinessHealth(server), self._hello)
        self._dir = Path(tempfile.mkdtemp(prefix="kiln-grpc-"))
        self._socket = self._dir / "bridge.sock"
        self._unix: asyncio.base_events.Server | None = None
        self._processes: list[asyncio.subprocess.Process] = []
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = False

    def _hello(self) -> None:
        self._hellos += 1
        if self._hellos >= self._count:
            self._all_listening.set()

    async def start(self) -> None:
        self._unix = await asyncio.get_running_loop().create_unix_server(self._core.connection, str(self._socket))
        self._processes = [await self._spawn() for _ in range(self._count)]
        listening = asyncio.create_task(self._all_listening.wait())
        exits = [asyncio.create_task(p.wait()) for p in self._processes]
        done, _ = await asyncio.wait([listening, *exits], timeout=START_TIMEOUT_S,
                                     return_when=asyncio.FIRST_COMPLETED)
        for task in exits:
            task.cancel()
        if listening not in done:
            listening.cancel()
            await self.stop(0)
            raise OSError(f"gRPC frontend: the workers did not start listening on {self._address} (a worker "
                          f"exited or none answered within {START_TIMEOUT_S:.0f} s; see the log above)")
        self._supervisor = asyncio.create_task(self._supervise())

    async def _spawn(self) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kiln.frontends.grpc.worker", "--bridge", str(self._socket),
            "--address", self._address, "--max-message-bytes", str(self._max_message_bytes),
            "--grace", str(self._grace_s))

    async def _supervise(self) -> None:
        while not self._stopping:
            waits = {asyncio.create_task(p.wait()): i for i, p in enumerate(self._processes)}
            done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            for task in done:
                index = waits[task]
                if self._stopping:
                    return
                log.error("gRPC worker %d (pid %d) exited with %s; starting a new one", index,
                          self._processes[index].pid, task.result())
                await asyncio.sleep(RESTART_DELAY_S)  # a worker that cannot start must not spin the CPU
                if self._stopping:
                    return
                self._processes[index] = await self._spawn()

    async def stop(self, grace: float | None = None) -> None:
        self._stopping = True
        if self._supervisor is not None:
            self._supervisor.cancel()
        for process in self._processes:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
        wait_s = (grace if grace is not None else self._grace_s) + 5.0
        for process in self._processes:
            try:
                await asyncio.wait_for(process.wait(), wait_s)
            except TimeoutError:
                process.kill()
                await process.wait()
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
