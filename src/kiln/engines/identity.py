"""Identity engine: output i is input i. For tests and for measuring serving overhead without a model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from kiln.config.spec import ModelSpec
from kiln.engines.base import Array, Engine, EngineOptions
from kiln.errors import ConfigError


class IdentityEngine(Engine):
    thread_safe = True
    def __init__(self, spec: ModelSpec, model_file: Path, options: EngineOptions) -> None:
        super().__init__(spec)
        if len(spec.outputs) > len(spec.inputs):
            raise ConfigError(f"model '{spec.name}': the identity backend needs at least as many inputs as outputs "
                              f"({len(spec.inputs)} inputs, {len(spec.outputs)} outputs)")
        for source, target in zip(spec.inputs, spec.outputs, strict=False):
            if source.datatype is not target.datatype:
                raise ConfigError(
                    f"model '{spec.name}': identity output '{target.name}' is {target.datatype.config_name} but "
                    f"input '{source.name}' is {source.datatype.config_name}; they must match"
                )
        self._source = {out.name: inp.name for inp, out in zip(spec.inputs, spec.outputs, strict=False)}

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        return {name: inputs[self._source[name]] for name in outputs}
