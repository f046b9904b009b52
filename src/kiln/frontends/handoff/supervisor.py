"""Worker processes that the server process starts, counts as started once each has said hello, replaces when
one dies, and stops with SIGTERM so that each drains its requests."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable

log = logging.getLogger("kiln.workers")

START_TIMEOUT_S = 60.0
RESTART_DELAY_S = 0.5

Spawn = Callable[[int], Awaitable[asyncio.subprocess.Process]]


class WorkerPool:
    """``count`` processes made by ``spawn(index)``; ``what`` names them in the log ("HTTP worker")."""

    def __init__(self, what: str, count: int, spawn: Spawn) -> None:
        self.what = what
        self.count = count
        self._spawn = spawn
        self._hellos = 0
        self._all_listening = asyncio.Event()
        self.processes: list[asyncio.subprocess.Process] = []
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = False

    def hello(self) -> None:
        """A worker listens (replacements say it too; only the first ``count`` matter)."""
        self._hellos += 1
        if self._hellos >= self.count:
            self._all_listening.set()

    async def start(self, where: str) -> None:
        """Start the workers and return once all listen; OSError when one exits first or they take too long."""
        self.processes = [await self._spawn(i) for i in range(self.count)]
        listening = asyncio.create_task(self._all_listening.wait())
        exits = [asyncio.create_task(p.wait()) for p in self.processes]
        done, _ = await asyncio.wait([listening, *exits], timeout=START_TIMEOUT_S,
                                     return_when=asyncio.FIRST_COMPLETED)
        for task in exits:
            task.cancel()
        if listening not in done:
            listening.cancel()
            await self.stop(0)
            raise OSError(f"{self.what}s did not start listening on {where} (a worker exited or none answered "
                          f"within {START_TIMEOUT_S:.0f} s; see the log above)")
        self._supervisor = asyncio.create_task(self._supervise())

    async def _supervise(self) -> None:
        while not self._stopping:
            waits = {asyncio.create_task(p.wait()): i for i, p in enumerate(self.processes)}
            done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            for task in done:
                index = waits[task]
                if self._stopping:
                    return
                log.error("%s %d (pid %d) exited with %s; starting a new one", self.what, index,
                          self.processes[index].pid, task.result())
                await asyncio.sleep(RESTART_DELAY_S)  # a worker that cannot start must not spin the CPU
                if self._stopping:
                    return
                self.processes[index] = await self._spawn(index)

    async def stop(self, wait_s: float) -> None:
        """SIGTERM every worker, wait up to ``wait_s`` for each to drain and exit, kill those that do not."""
        self._stopping = True
        if self._supervisor is not None:
            self._supervisor.cancel()
        for process in self.processes:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                await asyncio.wait_for(process.wait(), wait_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):  # it exited since: nothing to kill
                    process.kill()
                await process.wait()
