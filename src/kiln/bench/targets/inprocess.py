"""The inprocess target: a ``kiln.Server`` in this process, its schedulers included, called through
``await server.infer(...)`` on an event loop as the frontends call it, without any network or codec.

Only the measured model is loaded (explicit control mode), so a large repository costs nothing extra.
"""

from __future__ import annotations

import asyncio
import os
from typing import Protocol

from kiln import Server, ServerOptions
from kiln.bench.data import ModelInputs, Request
from kiln.bench.options import BenchOptions
from kiln.bench.records import ClientTimes
from kiln.bench.server_stats import Duration, ServerCounters, add_counters
from kiln.bench.targets.aio import AsyncTarget
from kiln.errors import ModelNotReadyError
from kiln.tensor import DataType
from kiln.v2.types import InferRequest, InputTensor


class InProcessTarget(AsyncTarget):
    kind = "inprocess"
    in_process = True

    def __init__(self, options: BenchOptions) -> None:
        super().__init__(options.model)
        assert options.model_repository is not None  # BenchOptions checks it
        self._server_options = ServerOptions(repositories=[options.model_repository], control_mode="explicit",
                                             load_models=(options.model,))
        self._version = options.model_version
        self._server: Server | None = None
        self._datatypes: dict[str, DataType] = {}

    async def aopen(self) -> ModelInputs:
        server = Server(self._server_options)
        self._server = server
        failed = await asyncio.get_running_loop().run_in_executor(None, server.start)
        if failed:
            reasons = [e.reason for e in server.repository_index() if e.name == self.model and e.reason]
            raise ModelNotReadyError(f"model '{self.model}' did not load in the in-process server: "
                                     f"{'; '.join(reasons) or 'see the log'}")
        metadata = server.model_metadata(self.model, self._version)
        config = server.model_config(self.model, self._version)
        self._datatypes = {t.name: t.datatype for t in metadata.inputs}
        return ModelInputs(self.model, tuple(metadata.inputs), int(config.max_batch_size))

    async def ainfer(self, slot: int, request: Request) -> ClientTimes | None:
        assert self._server is not None
        inputs = [InputTensor(name, self._datatypes[name], array.shape, array) for name, array in request.items()]
        await self._server.infer(InferRequest(model_name=self.model, inputs=inputs, model_version=self._version))
        return None

    async def astats(self) -> ServerCounters | None:
        assert self._server is not None
        return add_counters(counters(s) for s in self._server.model_statistics(self.model, self._version))

    async def aclose(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await asyncio.get_running_loop().run_in_executor(None, server.close)

    def process_id(self) -> int | None:
        return os.getpid()


class _Count(Protocol):
    @property
    def count(self) -> int: ...

    @property
    def ns(self) -> int: ...


class _Stats(Protocol):
    """What the bench reads of one entry of ``Server.model_statistics``."""

    @property
    def success(self) -> _Count: ...


def counters(stats: _Stats) -> ServerCounters:
    phases = {name: Duration(getattr(stats, name).count, getattr(stats, name).ns)
              for name in ("queue", "compute_input", "compute_infer", "compute_output")}
    return ServerCounters(stats.success.count, phases)
