"""A loaded model version: its spec, engine instances and statistics, and how one request runs on an engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy.typing as npt

from kiln.config.spec import ModelSpec
from kiln.engines.base import Engine
from kiln.errors import InternalError, KilnError
from kiln.server.classification import classify, read_labels
from kiln.server.request import InferRequest, InferResponse, OutputTensor
from kiln.server.stats import ExecutionTimes, StatsRecorder
from kiln.tensor import DataType


@dataclass
class LoadedModel:
    spec: ModelSpec
    version: int
    path: Path
    engines: list[Engine]
    stats: StatsRecorder = field(init=False)
    labels: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.stats = StatsRecorder(self.spec.name, str(self.version))
        for tensor in self.spec.outputs:
            if tensor.label_filename:
                self.labels[tensor.name] = read_labels(self.path / tensor.label_filename)

    @property
    def name(self) -> str:
        return self.spec.name

    def close(self) -> None:
        for engine in self.engines:
            engine.close()

    def run(self, engine: Engine, request: InferRequest, batch_size: int,
            enqueued_ns: int) -> tuple[InferResponse, ExecutionTimes]:
        """Execute one request on ``engine`` (in a worker thread) and build its response."""
        start = time.monotonic_ns()
        feed = {tensor.name: tensor.data for tensor in request.inputs}
        names = [o.name for o in request.outputs] or [t.name for t in self.spec.outputs]
        infer_start = time.monotonic_ns()
        try:
            results = engine.execute(feed, names)
        except KilnError:
            raise
        except Exception as exc:  # an engine's own failure: report it as INTERNAL, never crash the worker
            raise InternalError(f"model '{self.name}' version {self.version}: {type(exc).__name__}: {exc}") from exc
        infer_end = time.monotonic_ns()
        outputs = [self._output(name, results[name], request) for name in names]
        end = time.monotonic_ns()
        times = ExecutionTimes(batch_size, start - enqueued_ns, infer_start - start, infer_end - infer_start,
                               end - infer_end)
        response = InferResponse(model_name=self.name, model_version=str(self.version), outputs=outputs,
                                 id=request.id)
        return response, times

    def _output(self, name: str, data: npt.NDArray[Any], request: InferRequest) -> OutputTensor:
        spec = self.spec.output(name)
        wanted = next((o for o in request.outputs if o.name == name), None)
        if wanted is not None and wanted.classification > 0:
            classes = classify(self.name, name, data, wanted.classification, self.spec.batching,
                               self.labels.get(name, []))
            return OutputTensor(name, DataType.BYTES, classes.shape, classes)
        return OutputTensor(name, spec.datatype, tuple(data.shape), data)
