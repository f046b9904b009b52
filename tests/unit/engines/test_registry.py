"""The backend registry and the Engine base class."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.config.spec import ModelSpec, TensorSpec
from kiln.engines import Engine, EngineOptions, backend_names, base, create_engine, register_backend
from kiln.engines.base import Array, empty_like_spec
from kiln.errors import UnsupportedError
from kiln.tensor import DataType
from kiln.testing import write_model
from kiln.v2._generated import model_config_pb2 as pb


@pytest.fixture(autouse=True)
def _isolated_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    yield


def _spec(backend: str, max_batch_size: int = 0) -> ModelSpec:
    tensor = TensorSpec("I", DataType.FP32, (2, -1))
    return ModelSpec(name="m", backend=backend, platform="", max_batch_size=max_batch_size, inputs=(tensor,),
                     outputs=(TensorSpec("O", DataType.FP32, (2, -1)),), config=pb.ModelConfig(name="m"))


class DoublingEngine(Engine):
    def __init__(self, spec: ModelSpec, model_file: Path, options: EngineOptions) -> None:
        super().__init__(spec)
        self.model_file = model_file
        self.options = options
        self.closed = 0

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        return {name: inputs["I"] * 2 for name in outputs}

    def close(self) -> None:
        self.closed += 1


def test_builtin_backends() -> None:
    assert {"identity", "onnxruntime"} <= set(backend_names())
    assert backend_names() == sorted(backend_names())


def test_unknown_backend_lists_available_ones() -> None:
    with pytest.raises(UnsupportedError) as info:
        create_engine(_spec("tensorflow"), Path("model.savedmodel"))
    message = str(info.value)
    assert message.startswith("model 'm': backend 'tensorflow' is not available in this kiln installation")
    assert f"(available: {', '.join(backend_names())})" in message
    assert "identity" in message and "onnxruntime" in message


def test_register_backend_with_a_custom_factory() -> None:
    register_backend("doubling", DoublingEngine)
    assert "doubling" in backend_names()
    engine = create_engine(_spec("doubling"), Path("weights.bin"))
    assert isinstance(engine, DoublingEngine)
    assert engine.model_file == Path("weights.bin")
    assert engine.options == EngineOptions()  # the default options when none are given
    out = engine.infer({"I": np.ones((2, 3), dtype=np.float32)})
    np.testing.assert_array_equal(out["O"], np.full((2, 3), 2, dtype=np.float32))
    options = EngineOptions(kind="gpu", device_id=3, extra={"k": "v"})
    assert create_engine(_spec("doubling"), Path("w"), options).options is options  # type: ignore[attr-defined]


def test_register_backend_replaces_a_builtin() -> None:
    register_backend("identity", DoublingEngine)
    assert isinstance(create_engine(_spec("identity"), Path(".")), DoublingEngine)


def test_registered_backend_is_usable_from_a_config(tmp_path: Path) -> None:
    register_backend("doubling", DoublingEngine)
    folder = write_model(tmp_path, "m", None, 'backend: "doubling"\n'
                         'input [ { name: "I" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
                         'output [ { name: "O" data_type: TYPE_FP32 dims: [ 2 ] } ]')
    assert isinstance(kiln.load(folder), DoublingEngine)


def test_engine_is_abstract() -> None:
    with pytest.raises(TypeError):
        Engine(_spec("x"))  # type: ignore[abstract]


def test_engine_properties_and_context_manager() -> None:
    spec = _spec("doubling")
    with DoublingEngine(spec, Path("w"), EngineOptions()) as engine:
        assert engine.name == "m"
        assert engine.inputs == spec.inputs and engine.outputs == spec.outputs
        assert engine.spec is spec
    assert engine.closed == 1


def test_engine_options_defaults() -> None:
    options = EngineOptions()
    assert (options.kind, options.device_id, options.intra_op_threads, options.inter_op_threads) == ("cpu", 0, None,
                                                                                                      None)
    assert dict(options.extra) == {}
    with pytest.raises(AttributeError):
        options.kind = "gpu"  # type: ignore[misc]


def test_empty_like_spec() -> None:
    spec = _spec("x")
    zeros = empty_like_spec(spec.inputs[0], batch=3)
    assert zeros.shape == (3, 2, 1)  # the variable dim becomes 1
    assert zeros.dtype == np.float32
    assert not zeros.any()
    strings = empty_like_spec(TensorSpec("S", DataType.BYTES, (2,)), batch=1)
    assert strings.dtype == np.dtype(object) and strings.shape == (1, 2)
