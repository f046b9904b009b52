"""The direct target: ``kiln.load`` in this process and N threads calling ``engine.infer`` (``--direct-calls
asyncio``: N tasks on one event loop awaiting ``engine.ainfer``, as an asyncio application calls it).

An engine that may run on several threads at once (``thread_safe``: onnxruntime, eager torch) is shared by every
thread; any other engine (TensorRT, compiled torch, Python models) is loaded once per request slot, as an
application running N threads would have to, so memory grows with concurrency there.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from kiln.bench.data import ModelInputs, Request
from kiln.bench.options import BenchOptions
from kiln.bench.records import ClientTimes
from kiln.bench.targets.aio import AsyncTarget
from kiln.bench.targets.base import Target
from kiln.bench.targets.threaded import ThreadedTarget
from kiln.direct import load
from kiln.engines.base import Engine
from kiln.errors import InvalidArgumentError

log = logging.getLogger("kiln.bench")


def direct_target(options: BenchOptions) -> Target:
    return DirectAsyncTarget(options) if options.direct_calls == "asyncio" else DirectTarget(options)


class DirectTarget(ThreadedTarget):
    kind = "direct"
    in_process = True

    def __init__(self, options: BenchOptions) -> None:
        super().__init__(options.model)
        repository = options.model_repository
        self.path = repository / options.model if repository is not None else Path(options.model)
        self.model_name = self.path.stem if repository is None else options.model
        self._version = _version(options.model_version)
        self._load_options: dict[str, Any] = {} if options.device == "config" else {"kind": options.device}
        if options.intra_op_threads is not None:
            self._load_options["intra_op_threads"] = options.intra_op_threads
        self._engines: list[Engine] = []

    def open(self) -> ModelInputs:
        engine = load(self.path, version=self._version, **self._load_options)
        self._engines = [engine]
        return ModelInputs(self.model_name, engine.spec.inputs, engine.spec.max_batch_size)

    @property
    def shared(self) -> bool:
        return bool(self._engines) and self._engines[0].thread_safe

    def ensure_slots(self, count: int) -> None:
        if self.shared or len(self._engines) >= count:
            return
        log.info("kiln bench: %s engines run one request at a time; loading %d more for %d slots",
                 type(self._engines[0]).__name__, count - len(self._engines), count)
        while len(self._engines) < count:
            self._engines.append(load(self.path, version=self._version, **self._load_options))

    def infer(self, slot: int, request: Request) -> ClientTimes | None:
        engine = self._engines[0] if self.shared else self._engines[slot]
        engine.infer(request)
        return None

    def process_id(self) -> int | None:
        return os.getpid()

    def close(self) -> None:
        engines, self._engines = self._engines, []
        for engine in engines:
            engine.close()


class DirectAsyncTarget(AsyncTarget):
    """One engine shared by N tasks of one event loop; the engine's own batching (if on) coalesces them."""

    kind = "direct"
    in_process = True

    def __init__(self, options: BenchOptions) -> None:
        super().__init__(options.model)
        self._threads = DirectTarget(options)  # the same model path, version and load options
        self.model_name = self._threads.model_name
        self._engine: Engine | None = None

    async def aopen(self) -> ModelInputs:
        threads = self._threads
        self._engine = load(threads.path, version=threads._version, **threads._load_options)
        return ModelInputs(self.model_name, self._engine.spec.inputs, self._engine.spec.max_batch_size)

    async def ainfer(self, slot: int, request: Request) -> ClientTimes | None:
        assert self._engine is not None
        await self._engine.ainfer(request)
        return None

    async def aclose(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    def process_id(self) -> int | None:
        return os.getpid()


def _version(text: str) -> int | None:
    if not text:
        return None
    if not text.isdigit():
        raise InvalidArgumentError(f"model version is '{text}'; expected a version number such as 1")
    return int(text)
