"""What the batching core runs: a model version's engine instances, and how a batch of requests executes on one.

The server's LoadedModel builds on :class:`BatchModel` (adding classification outputs and its statistics); the
direct engine uses it as it is, with :class:`BatchLog` as its record.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy.typing as npt

from kiln.config.spec import ModelSpec
from kiln.engines.base import Engine, LaunchedBatch
from kiln.errors import InternalError, KilnError
from kiln.v2.types import InferRequest, InferResponse, OutputTensor

Array = npt.NDArray[Any]


@dataclass(frozen=True)
class ExecutionTimes:
    """What one execution of a batch cost, in nanoseconds."""

    batch_size: int
    start_ns: int  # monotonic time the execution began; a request's queue time ends here
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int


class Recorder(Protocol):
    """Where the batching core reports executions and failed requests (the server's StatsRecorder, BatchLog)."""

    def record_success(self, times: ExecutionTimes, enqueued_ns: list[int], end_ns: int,
                       joined: tuple[int, int, int] = (0, 0, 0)) -> None: ...

    def record_failure(self, request_ns: int, reason: str = "BACKEND", requests: int = 1) -> None: ...


class BatchLog:
    """A light record for the direct engine: how many executions ran, their batch sizes, and failures."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.executions = 0
        self.inferences = 0
        self.batch_sizes: dict[int, int] = {}  # batch size (rows) -> executions of that size
        self.failures: dict[str, int] = {}  # reason -> failed requests
        self.last_batch_size = 0

    def record_success(self, times: ExecutionTimes, enqueued_ns: list[int], end_ns: int,
                       joined: tuple[int, int, int] = (0, 0, 0)) -> None:
        with self._lock:
            self.executions += 1
            self.inferences += times.batch_size
            self.batch_sizes[times.batch_size] = self.batch_sizes.get(times.batch_size, 0) + 1
            self.last_batch_size = times.batch_size

    def record_failure(self, request_ns: int, reason: str = "BACKEND", requests: int = 1) -> None:
        with self._lock:
            self.failures[reason] = self.failures.get(reason, 0) + requests


def arrivals(enqueued: Iterable[tuple[int, InferRequest]]) -> list[int]:
    """The arrival time of every client request in a batch, for ``record_success``: a request that stands for
    several (InferRequest.members) counts as each of them."""
    return [ns for ns, request in enqueued for _ in range(request.members)]


def joined_counts(requests: Iterable[InferRequest]) -> tuple[int, int, int]:
    """For ``record_success``: how many of a batch's requests were joined from several clients' requests
    (kiln.v2.joined), how many clients' requests those carried, and how many clients' requests a worker held
    for an answer before sending them."""
    joined = members = held = 0
    for request in requests:
        held += request.held
        if request.members > 1:
            joined += 1
            members += request.members
    return joined, members, held


class BatchModel:
    """A model version's spec and engine instances; runs requests with identical input shapes as one batch."""

    def __init__(self, spec: ModelSpec, version: int, engines: list[Engine], stats: Recorder) -> None:
        self.spec = spec
        self.version = version
        self.engines = engines
        self.stats = stats
        self._all_outputs = [t.name for t in spec.outputs]
        self._version_text = str(version)

    @property
    def name(self) -> str:
        return self.spec.name

    def close(self) -> None:
        for engine in self.engines:
            engine.close()

    def run_batch(self, engine: Engine, requests: list[InferRequest],
                  rows: list[int]) -> tuple[list[InferResponse], ExecutionTimes]:
        """Execute requests with identical input shapes as one batch; split the outputs back per request."""
        start = time.monotonic_ns()
        parts, names = _parts(requests), _output_names(self.spec, requests)
        infer_start = time.monotonic_ns()
        try:
            results = engine.execute_parts(parts, names)
        except KilnError:
            raise
        except Exception as exc:  # an engine's own failure: report it as INTERNAL, never crash the worker
            raise self._engine_failure(exc) from exc
        infer_end = time.monotonic_ns()
        responses = self.responses(requests, rows, results)
        end = time.monotonic_ns()
        times = ExecutionTimes(sum(rows), start, infer_start - start,
                               infer_end - infer_start, end - infer_end)
        return responses, times

    def launch_batch(self, engine: Engine, requests: list[InferRequest]) -> LaunchedBatch | None:
        """Queue requests with identical input shapes on ``engine``'s device as one batch (Engine.launch_parts);
        None when the engine has no free buffers for it now."""
        try:
            return engine.launch_parts(_parts(requests), _output_names(self.spec, requests))
        except KilnError:
            raise
        except Exception as exc:
            raise self._engine_failure(exc) from exc

    def _engine_failure(self, exc: Exception) -> InternalError:
        return InternalError(f"model '{self.name}' version {self.version}: {type(exc).__name__}: {exc}")

    def responses(self, requests: list[InferRequest], rows: list[int],
                  results: dict[str, Array]) -> list[InferResponse]:
        """A batch's outputs split back into one response per request."""
        responses: list[InferResponse] = []
        offset = 0
        single = len(requests) == 1
        for request, count in zip(requests, rows, strict=True):
            if request.outputs:
                outputs = [self.output(o.name, results[o.name] if single else results[o.name][offset:offset + count],
                                       o.classification) for o in request.outputs]
            else:
                outputs = [self.output(name, results[name] if single else results[name][offset:offset + count], 0)
                           for name in self._all_outputs]
            responses.append(InferResponse(model_name=self.name, model_version=self._version_text, outputs=outputs,
                                           id=request.id))
            offset += count
        return responses

    def output(self, name: str, data: Array, classification: int) -> OutputTensor:
        """One output tensor of a response; the server's LoadedModel adds classification."""
        return OutputTensor(name, self.spec.output_map[name].datatype, data.shape, data)


def _parts(requests: list[InferRequest]) -> list[dict[str, Any]]:
    """Each request's input arrays by name: one part of a batch; a joined request whose members' inputs lie in
    their own shared-memory regions gives one part per member, read where it lies (kiln.v2.joined)."""
    parts: list[dict[str, Any]] = []
    for request in requests:
        if request.member_rows:
            parts.extend({tensor.name: tensor.parts[index] for tensor in request.inputs}
                         for index in range(len(request.member_rows)))
        else:
            parts.append({tensor.name: tensor.data for tensor in request.inputs})
    return parts


def _output_names(spec: ModelSpec, requests: list[InferRequest]) -> list[str]:
    """The union of what the requests asked for, in the model's output order (all outputs when one asks none)."""
    if any(not request.outputs for request in requests):
        return [t.name for t in spec.outputs]
    wanted = {o.name for request in requests for o in request.outputs}
    return [t.name for t in spec.outputs if t.name in wanted]
