"""A loaded model version: the batching core's BatchModel plus what the server adds (its folder, labels for
classification outputs, statistics)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy.typing as npt

from kiln.batching.model import BatchModel
from kiln.config.spec import ModelSpec
from kiln.engines.base import Engine
from kiln.server.classification import classify, read_labels
from kiln.server.stats import RequestObserver, StatsRecorder
from kiln.tensor import DataType
from kiln.v2.types import OutputTensor


class LoadedModel(BatchModel):
    stats: StatsRecorder

    def __init__(self, spec: ModelSpec, version: int, path: Path, engines: list[Engine],
                 observers: list[RequestObserver] | None = None, stats: StatsRecorder | None = None) -> None:
        """``observers`` is shared with the Server (see Server.add_request_observer); ``stats`` is passed on when
        instances are resized in place, so the counters continue."""
        super().__init__(spec, version, engines, stats or StatsRecorder(spec.name, str(version), observers))
        self.path = path
        self.labels = {t.name: read_labels(path / t.label_filename) for t in spec.outputs if t.label_filename}
        # Set when instances are resized in place: close() releases only these (the rest live on).
        self.release_only: list[Engine] | None = None

    def close(self) -> None:
        for engine in self.engines if self.release_only is None else self.release_only:
            engine.close()

    def output(self, name: str, data: npt.NDArray[Any], classification: int) -> OutputTensor:
        if classification > 0:
            classes = classify(self.name, name, data, classification, self.spec.batching, self.labels.get(name, []))
            return OutputTensor(name, DataType.BYTES, classes.shape, classes)
        return super().output(name, data, classification)
