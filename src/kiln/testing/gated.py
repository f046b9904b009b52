"""An engine that holds its batch until a test lets it go: for tests of requests in flight (draining on shutdown,
a worker's client hanging up mid-request). One gate per process: register it under a backend name of the test's
own and clear both events before use."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from kiln.config.spec import ModelSpec
from kiln.engines import Engine, EngineOptions
from kiln.engines.base import Array

GATE = threading.Event()
"""Set it to let the held batch finish."""
ENTERED = threading.Event()
"""Set once a batch is inside ``execute``."""


class GatedEngine(Engine):
    """Answers ``y = x + 1``, once GATE is set (at most 30 s after the batch came in)."""

    def __init__(self, spec: ModelSpec, model_file: Path, options: EngineOptions) -> None:
        super().__init__(spec)

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        ENTERED.set()
        GATE.wait(30)
        return {outputs[0]: inputs["x"] + 1}
