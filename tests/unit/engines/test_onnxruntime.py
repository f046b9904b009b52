"""The ONNX Runtime engine on tiny models: results, providers, session options, reshape and BYTES tensors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from kiln.config import open_model_dir
from kiln.config.spec import ModelSpec
from kiln.engines import EngineOptions, create_engine
from kiln.engines.onnxruntime import OnnxRuntimeEngine
from kiln.errors import ConfigError, InternalError, InvalidArgumentError, UnavailableError
from kiln.tensor import DataType
from kiln.testing import onnx_add_sub_model, onnx_identity_model, write_model


def _spec(tmp_path: Path, model: onnx.ModelProto, config: str | None = None, name: str = "m") -> ModelSpec:
    return open_model_dir(write_model(tmp_path, name, model, config)).spec


def _engine(tmp_path: Path, model: onnx.ModelProto, config: str | None = None,
            options: EngineOptions | None = None, name: str = "m") -> OnnxRuntimeEngine:
    spec = _spec(tmp_path, model, config, name)
    engine = create_engine(spec, tmp_path / name / "1" / "model.onnx", options)
    assert isinstance(engine, OnnxRuntimeEngine)
    return engine


@pytest.fixture
def sessions(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Record what kiln passes to ort.InferenceSession; the real session always runs on the CPU provider."""
    calls: list[dict[str, Any]] = []
    real = ort.InferenceSession

    def record(path: str, sess_options: ort.SessionOptions | None = None, providers: Any = None) -> Any:
        calls.append({"path": path, "sess_options": sess_options, "providers": providers})
        return real(path, sess_options=sess_options, providers=["CPUExecutionProvider"])

    monkeypatch.setattr(ort, "InferenceSession", record)
    return calls


def test_add_sub_results(tmp_path: Path) -> None:
    engine = _engine(tmp_path, onnx_add_sub_model(DataType.INT32, dims=(16,)))
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    b = np.full((2, 16), 3, dtype=np.int32)
    out = engine.infer({"INPUT0": a, "INPUT1": b})
    assert list(out) == ["OUTPUT0", "OUTPUT1"]
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)
    assert out["OUTPUT0"].dtype == np.int32
    assert engine.name == "m"
    assert [t.name for t in engine.inputs] == ["INPUT0", "INPUT1"]
    assert [t.name for t in engine.outputs] == ["OUTPUT0", "OUTPUT1"]


def test_output_subset_and_order(tmp_path: Path) -> None:
    engine = _engine(tmp_path, onnx_add_sub_model())
    x = np.ones((1, 4), dtype=np.float32)
    assert list(engine.infer({"INPUT0": x, "INPUT1": x}, outputs=["OUTPUT1"])) == ["OUTPUT1"]
    both = engine.infer({"INPUT0": x * 5, "INPUT1": x}, outputs=["OUTPUT1", "OUTPUT0"])
    assert list(both) == ["OUTPUT1", "OUTPUT0"]
    np.testing.assert_array_equal(both["OUTPUT1"], x * 4)
    np.testing.assert_array_equal(both["OUTPUT0"], x * 6)


def test_unknown_output(tmp_path: Path) -> None:
    engine = _engine(tmp_path, onnx_add_sub_model())
    x = np.ones((1, 4), dtype=np.float32)
    with pytest.raises(InvalidArgumentError) as info:
        engine.infer({"INPUT0": x, "INPUT1": x}, outputs=["OUT"])
    assert str(info.value) == "model 'm': unknown output 'OUT'; expected one of: OUTPUT0, OUTPUT1"


def test_non_contiguous_input(tmp_path: Path) -> None:
    engine = _engine(tmp_path, onnx_add_sub_model())
    big = np.arange(32, dtype=np.float32).reshape(4, 8)
    a = big[:, ::2]  # [4, 4], strided
    out = engine.infer({"INPUT0": a, "INPUT1": np.zeros((4, 4), np.float32)})
    np.testing.assert_array_equal(out["OUTPUT0"], a)


def test_closed_engine(tmp_path: Path) -> None:
    engine = _engine(tmp_path, onnx_add_sub_model())
    engine.close()
    engine.close()  # idempotent
    x = np.ones((1, 4), dtype=np.float32)
    with pytest.raises(UnavailableError, match="model 'm': the engine is closed"):
        engine.infer({"INPUT0": x, "INPUT1": x})
    with pytest.raises(UnavailableError, match="the engine is closed"):
        _ = engine.providers


def test_context_manager_closes(tmp_path: Path) -> None:
    with _engine(tmp_path, onnx_add_sub_model()) as engine:
        assert engine.providers == ["CPUExecutionProvider"]
    with pytest.raises(UnavailableError):
        engine.execute({}, [])


def test_cpu_provider_by_default(tmp_path: Path, sessions: list[dict[str, Any]]) -> None:
    engine = _engine(tmp_path, onnx_add_sub_model())
    assert engine.providers == ["CPUExecutionProvider"]
    assert sessions[0]["providers"] == ["CPUExecutionProvider"]
    assert sessions[0]["path"] == str(tmp_path / "m" / "1" / "model.onnx")


def test_gpu_without_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider", "AzureExecutionProvider"])
    with pytest.raises(UnavailableError) as info:
        _engine(tmp_path, onnx_add_sub_model(), options=EngineOptions(kind="gpu"))
    assert str(info.value) == (
        "model 'm': a GPU instance was requested, but this onnxruntime has no CUDA execution provider "
        "(available: AzureExecutionProvider, CPUExecutionProvider); install onnxruntime-gpu or use KIND_CPU"
    )


def test_gpu_providers_requested(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 sessions: list[dict[str, Any]]) -> None:
    monkeypatch.setattr(ort, "get_available_providers",
                        lambda: ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"])
    _engine(tmp_path, onnx_add_sub_model(), options=EngineOptions(kind="gpu", device_id=1), name="a")
    assert sessions[-1]["providers"] == [("CUDAExecutionProvider", {"device_id": "1"}), "CPUExecutionProvider"]
    trt = ("optimization { execution_accelerators { gpu_execution_accelerator [ { name: \"tensorrt\" } ] } }")
    _engine(tmp_path, onnx_add_sub_model(), trt, options=EngineOptions(kind="gpu"), name="b")
    assert sessions[-1]["providers"] == [
        ("TensorrtExecutionProvider", {"device_id": "0"}),
        ("CUDAExecutionProvider", {"device_id": "0"}),
        "CPUExecutionProvider",
    ]


def _threads(name: str, value: str) -> str:
    return f'parameters {{ key: "{name}" value: {{ string_value: "{value}" }} }}'


def test_thread_count_parameters(tmp_path: Path, sessions: list[dict[str, Any]]) -> None:
    config = _threads("intra_op_thread_count", "3") + "\n" + _threads("inter_op_thread_count", "2")
    _engine(tmp_path, onnx_add_sub_model(), config)
    options = sessions[-1]["sess_options"]
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (3, 2)


def test_thread_count_options_override_parameters(tmp_path: Path, sessions: list[dict[str, Any]]) -> None:
    config = _threads("intra_op_thread_count", "3")
    _engine(tmp_path, onnx_add_sub_model(), config, EngineOptions(intra_op_threads=1, inter_op_threads=4))
    options = sessions[-1]["sess_options"]
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (1, 4)


def test_thread_count_default_and_non_positive(tmp_path: Path, sessions: list[dict[str, Any]]) -> None:
    _engine(tmp_path, onnx_add_sub_model(), None, name="a")
    _engine(tmp_path, onnx_add_sub_model(), _threads("intra_op_thread_count", "0"), name="b")
    _engine(tmp_path, onnx_add_sub_model(), _threads("intra_op_thread_count", ""), name="c")
    default = ort.SessionOptions().intra_op_num_threads
    assert [call["sess_options"].intra_op_num_threads for call in sessions] == [default] * 3


def test_bad_thread_count_parameter(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        _engine(tmp_path, onnx_add_sub_model(), _threads("intra_op_thread_count", "many"))
    assert str(info.value) == "model 'm': parameter 'intra_op_thread_count' is 'many'; expected an integer"


@pytest.mark.parametrize(
    ("level", "expected"),
    [
        (None, ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
        (-1, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC),
        (0, ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
        (1, ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED),
        (7, ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
    ],
)
def test_graph_optimization_level(tmp_path: Path, sessions: list[dict[str, Any]], level: int | None,
                                  expected: ort.GraphOptimizationLevel) -> None:
    config = None if level is None else f"optimization {{ graph {{ level: {level} }} }}"
    _engine(tmp_path, onnx_add_sub_model(), config)
    assert sessions[-1]["sess_options"].graph_optimization_level == expected


def test_reshape_batched(tmp_path: Path) -> None:
    config = ('max_batch_size: 4\n'
              'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2, 3 ] reshape: { shape: [ 6 ] } } ]\n'
              'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 3, 2 ] reshape: { shape: [ 6 ] } } ]')
    engine = _engine(tmp_path, onnx_identity_model(dims=(6,)), config)
    x = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    out = engine.infer({"INPUT0": x})["OUTPUT0"]
    assert out.shape == (2, 3, 2)
    np.testing.assert_array_equal(out.reshape(-1), x.reshape(-1))


def test_reshape_unbatched(tmp_path: Path) -> None:
    config = ('input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2, 3 ] reshape: { shape: [ 6 ] } } ]\n'
              'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 6 ] } ]')
    engine = _engine(tmp_path, onnx_identity_model(dims=(6,), batch=False), config)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = engine.infer({"INPUT0": x})["OUTPUT0"]
    assert out.shape == (6,)
    np.testing.assert_array_equal(out, x.reshape(-1))


def test_bytes_round_trip(tmp_path: Path) -> None:
    engine = _engine(tmp_path, onnx_identity_model(DataType.BYTES, dims=(2,)))
    assert engine.inputs[0].datatype is DataType.BYTES
    values = np.empty((2, 2), dtype=object)
    values[:] = [[b"abc", b""], ["h\u00e9", b"\x00x"]]  # bytes, str (sent as UTF-8) and an embedded NUL
    out = engine.infer({"INPUT0": values})["OUTPUT0"]
    assert out.dtype == np.dtype(object)
    assert out.shape == (2, 2)
    assert out.tolist() == [[b"abc", b""], ["h\u00e9".encode(), b"\x00x"]]
    assert all(type(v) is bytes for v in out.reshape(-1))


def test_bytes_from_numpy_string_arrays(tmp_path: Path) -> None:
    engine = _engine(tmp_path, onnx_identity_model(DataType.BYTES, dims=(2,)))
    assert engine.infer({"INPUT0": np.array([[b"a", b"bc"]])})["OUTPUT0"].tolist() == [[b"a", b"bc"]]
    assert engine.infer({"INPUT0": np.array([["x", "\u00fc"]])})["OUTPUT0"].tolist() == [[b"x", "\u00fc".encode()]]


def test_bytes_not_utf8_is_an_invalid_argument(tmp_path: Path) -> None:
    engine = _engine(tmp_path, onnx_identity_model(DataType.BYTES, dims=(1,)))
    with pytest.raises(InvalidArgumentError, match="INPUT0"):
        engine.infer({"INPUT0": np.array([[b"\xff"]], dtype=object)})


def test_model_onnx_folder(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", None)
    (folder / "1" / "model.onnx").mkdir()
    onnx.save(onnx_add_sub_model(), str(folder / "1" / "model.onnx" / "model.onnx"))
    spec = open_model_dir(folder).spec
    engine = create_engine(spec, folder / "1" / "model.onnx")
    x = np.ones((1, 4), dtype=np.float32)
    np.testing.assert_array_equal(engine.infer({"INPUT0": x, "INPUT1": x})["OUTPUT0"], 2 * x)


def test_missing_model_file(tmp_path: Path) -> None:
    spec = _spec(tmp_path, onnx_add_sub_model())
    missing = tmp_path / "m" / "2" / "model.onnx"
    with pytest.raises(ConfigError) as info:
        create_engine(spec, missing)
    assert str(info.value) == f"model 'm': model file {missing} does not exist"


def test_unloadable_model_file(tmp_path: Path) -> None:
    spec = _spec(tmp_path, onnx_add_sub_model())
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="^" + re.escape(f"model 'm': onnxruntime cannot load {bad}: ")):
        create_engine(spec, bad)


def test_run_failure_is_internal(tmp_path: Path) -> None:
    engine = _engine(tmp_path, onnx_add_sub_model())
    wrong = np.ones((1, 4), dtype=np.float64)  # execute() trusts its caller: onnxruntime rejects the type
    with pytest.raises(InternalError, match="^model 'm': onnxruntime failed: "):
        engine.execute({"INPUT0": wrong, "INPUT1": wrong}, ["OUTPUT0"])
