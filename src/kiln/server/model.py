"""A loaded model version: its spec, engine instances and statistics, and how one request runs on an engine."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy.typing as npt

from kiln.config.spec import ModelSpec
from kiln.engines.base import Engine, LaunchedBatch
from kiln.errors import InternalError, KilnError
from kiln.server.classification import classify, read_labels
from kiln.server.stats import ExecutionTimes, RequestObserver, StatsRecorder
from kiln.tensor import DataType
from kiln.v2.types import InferRequest, InferResponse, OutputTensor


class LoadedModel:
    def __init__(self, spec: ModelSpec, version: int, path: Path, engines: list[Engine],
                 observers: list[RequestObserver] | None = None, stats: StatsRecorder | None = None) -> None:
        """``observers`` is shared with the Server (see Server.add_request_observer); ``stats`` is passed on when
        instances are resized in place, so the counters continue."""
        self.spec = spec
        self.version = version
        self.path = path
        self.engines = engines
        self.stats = stats or StatsRecorder(spec.name, str(version), observers)
        self.labels = {t.name: read_labels(path / t.label_filename) for t in spec.outputs if t.label_filename}
        self._all_outputs = [t.name for t in spec.outputs]
        # Set when instances are resized in place: close() releases only these (the rest live on).
        self.release_only: list[Engine] | None = None
        self._version_text = str(version)

    @property
    def name(self) -> str:
        return self.spec.name

    def close(self) -> None:
        for engine in self.engines if self.release_only is None else self.release_only:
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
                  results: dict[str, npt.NDArray[Any]]) -> list[InferResponse]:
        """A batch's outputs split back into one response per request."""
        responses: list[InferResponse] = []
        offset = 0
        single = len(requests) == 1
        for request, count in zip(requests, rows, strict=True):
            if request.outputs:
                outputs = [self._output(o.name, results[o.name] if single else results[o.name][offset:offset + count],
                                        o.classification) for o in request.outputs]
            else:
                outputs = [self._output(name, results[name] if single else results[name][offset:offset + count], 0)
                           for name in self._all_outputs]
            responses.append(InferResponse(model_name=self.name, model_version=self._version_text, outputs=outputs,
                                           id=request.id))
            offset += count
        return responses

    def _output(self, name: str, data: npt.NDArray[Any], classification: int) -> OutputTensor:
        if classification > 0:
            classes = classify(self.name, name, data, classification, self.spec.batching, self.labels.get(name, []))
            return OutputTensor(name, DataType.BYTES, classes.shape, classes)
        return OutputTensor(name, self.spec.output_map[name].datatype, data.shape, data)


def _parts(requests: list[InferRequest]) -> list[dict[str, Any]]:
    """Each request's input arrays by name: one part of a batch."""
    return [{tensor.name: tensor.data for tensor in request.inputs} for request in requests]


def _output_names(spec: ModelSpec, requests: list[InferRequest]) -> list[str]:
    """The union of what the requests asked for, in the model's output order (all outputs when one asks none)."""
    if any(not request.outputs for request in requests):
        return [t.name for t in spec.outputs]
    wanted = {o.name for request in requests for o in request.outputs}
    return [t.name for t in spec.outputs if t.name in wanted]
