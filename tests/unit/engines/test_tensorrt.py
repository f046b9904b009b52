"""The TensorRT engine.

Without TensorRT (every machine kiln is tested on): the clear errors for a missing module, GPU or version, the
config-vs-plan check as a pure function, the numpy <-> torch buffer conversions, and that importing kiln never
imports tensorrt or torch. With TensorRT and a CUDA GPU (``gpu`` marker): plans built from a tiny ONNX model load
and agree with ONNX Runtime.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.config import open_model_dir
from kiln.config.spec import ModelSpec
from kiln.engines import EngineOptions, create_engine
from kiln.engines.tensorrt import (
    PlanTensor,
    check_plan_io,
    check_tensorrt_version,
    cuda_device,
    import_tensorrt,
    to_numpy,
    to_torch,
)
from kiln.errors import ConfigError, InvalidArgumentError, UnavailableError, UnsupportedError
from kiln.tensor import DataType
from kiln.testing import write_model

SRC = Path(__file__).resolve().parents[3] / "src"

CONFIG = """
name: "m"
backend: "tensorrt"
max_batch_size: 8
input [{ name: "x" data_type: TYPE_FP32 dims: [8] }]
output [{ name: "y" data_type: TYPE_FP32 dims: [4] }]
"""


def _spec(tmp_path: Path, config: str = CONFIG) -> ModelSpec:
    folder = write_model(tmp_path, "m", None, config)
    (folder / "1" / "model.plan").write_bytes(b"not a plan")
    return open_model_dir(folder).spec


def _plan(**changes: Any) -> list[PlanTensor]:
    x = PlanTensor("x", True, "FLOAT", (-1, 8), (1, 8), (8, 8))
    y = PlanTensor("y", False, "FLOAT", (-1, 4))
    return [changes.get("x", x), changes.get("y", y), *changes.get("extra", [])]


def test_version_10_is_accepted() -> None:
    assert check_tensorrt_version("10.9.0.34") == (10, 9)
    assert check_tensorrt_version("10.0.1") == (10, 0)


def test_version_11_is_refused_with_the_pin() -> None:
    with pytest.raises(UnsupportedError) as info:
        check_tensorrt_version("11.4.0.106")
    assert str(info.value) == (
        "TensorRT 11.4.0.106 is installed, but kiln's TensorRT backend uses the TensorRT 10 API: TensorRT 11 "
        "removed the FP16/BF16/INT8 builder flags and the INT8 calibrator it relies on; install TensorRT 10 with "
        "pip install 'kiln[tensorrt]' (tensorrt>=10,<11)")


@pytest.mark.parametrize(("version", "expected"), [
    ("8.6.1", "TensorRT 8.6.1 is installed, but kiln's TensorRT backend needs TensorRT 10"),
    ("unknown", "TensorRT reports version 'unknown'; kiln's TensorRT backend needs 10.x"),
])
def test_other_versions_are_refused(version: str, expected: str) -> None:
    with pytest.raises(UnsupportedError, match=f"^{expected}"):
        check_tensorrt_version(version)


def test_missing_tensorrt_is_unavailable_with_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # makes `import tensorrt` fail, installed or not
    with pytest.raises(UnavailableError) as info:
        import_tensorrt()
    assert str(info.value).startswith("the TensorRT backend needs the 'tensorrt' package, which cannot be imported")
    assert str(info.value).endswith("install it with pip install 'kiln[tensorrt]'")


def test_loading_a_plan_without_tensorrt_is_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    spec = _spec(tmp_path)
    assert spec.backend == "tensorrt"
    with pytest.raises(UnavailableError, match=r"pip install 'kiln\[tensorrt\]'"):
        create_engine(spec, tmp_path / "m" / "1" / "model.plan", EngineOptions(kind="gpu"))


def test_importing_kiln_imports_neither_tensorrt_nor_torch() -> None:
    code = ("import sys, kiln, kiln.engines.tensorrt, kiln.build.tensorrt, kiln.build.shapes; "
            "print(sorted(m for m in ('tensorrt', 'torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONPATH": str(SRC)})
    assert result.stdout.strip() == "[]"


def test_no_cuda_is_unavailable() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(UnavailableError) as info:
        cuda_device(0, "model 'm'")
    assert str(info.value) == ("model 'm': TensorRT needs a CUDA GPU, and none is visible "
                               "(torch.cuda.is_available() is False)")


def test_matching_plan_passes(tmp_path: Path) -> None:
    check_plan_io(_spec(tmp_path), _plan())
    # Plan outputs the config leaves out are allowed (computed and dropped).
    check_plan_io(_spec(tmp_path), _plan(extra=[PlanTensor("scores", False, "HALF", (-1, 2))]))


@pytest.mark.parametrize(("changes", "problem"), [
    ({"x": PlanTensor("x", True, "HALF", (-1, 8), (1, 8), (8, 8))},
     "input 'x' is TYPE_FP32 in the config but HALF (TYPE_FP16) in the plan"),
    ({"x": PlanTensor("x", True, "FP8", (-1, 8), (1, 8), (8, 8))},
     "plan input 'x' has TensorRT type FP8, which kiln cannot feed"),
    ({"y": PlanTensor("y", False, "FLOAT", (-1, 2, 2))},
     "output 'y' has 3 dimensions in the plan ([-1, 2, 2]) but 2 in the config ([-1, 4], batch dimension "
     "included (max_batch_size > 0))"),
    ({"y": PlanTensor("y", False, "FLOAT", (-1, 5))}, "output 'y' dimension 1 is 5 in the plan but 4 in the config"),
    ({"x": PlanTensor("x", True, "FLOAT", (8, 8))},
     "input 'x' has a fixed first dimension 8 in the plan; with max_batch_size > 0 it must be dynamic (rebuild "
     "with a batch range, or set max_batch_size: 0 and dims [8, 8])"),
    ({"x": PlanTensor("x", True, "FLOAT", (-1, 8), (1, 8), (4, 8))},
     "input 'x' accepts batch sizes 1...4 in the plan's profile, but max_batch_size 8 needs 1...8"),
    ({"y": PlanTensor("z", False, "FLOAT", (-1, 4))}, "config output 'y' is not in the plan (plan outputs: z)"),
    ({"extra": [PlanTensor("mask", True, "BOOL", (-1, 8), (1, 8), (8, 8))]},
     "the plan has input 'mask' (BOOL [-1, 8]), which the config does not declare"),
    ({"extra": [PlanTensor("scales", False, "FP8", (-1, 8))]},
     "the plan has output 'scales' of TensorRT type FP8, which kiln cannot allocate"),
])
def test_each_mismatch_is_named(tmp_path: Path, changes: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_plan_io(_spec(tmp_path), _plan(**changes))
    assert str(info.value) == f"model 'm': config.pbtxt does not match model.plan: {problem}"


def test_every_mismatch_is_named_in_one_error(tmp_path: Path) -> None:
    plan = [PlanTensor("x", False, "FLOAT", (-1, 8)), PlanTensor("y", False, "INT32", (-1, 4))]
    with pytest.raises(ConfigError) as info:
        check_plan_io(_spec(tmp_path), plan)
    assert str(info.value) == (
        "model 'm': config.pbtxt does not match model.plan: config input 'x' is an output in the plan; "
        "output 'y' is TYPE_FP32 in the config but INT32 (TYPE_INT32) in the plan")


def test_ranks_follow_reshape_and_unbatched_models(tmp_path: Path) -> None:
    config = """
    name: "m"
    backend: "tensorrt"
    input [{ name: "x" data_type: TYPE_INT64 dims: [6] reshape: { shape: [2, 3] } }]
    output [{ name: "y" data_type: TYPE_BF16 dims: [-1] }]
    """
    spec = _spec(tmp_path, config)
    check_plan_io(spec, [PlanTensor("x", True, "INT64", (2, 3)), PlanTensor("y", False, "BF16", (-1,))])
    with pytest.raises(ConfigError, match=r"input 'x' has 1 dimensions in the plan \(\[6\]\) but 2 in the config "
                                          r"\(\[2, 3\]\)$"):
        check_plan_io(spec, [PlanTensor("x", True, "INT64", (6,)), PlanTensor("y", False, "BF16", (-1,))])


@pytest.mark.parametrize("datatype", [DataType.FP32, DataType.FP16, DataType.BF16, DataType.INT8, DataType.INT32,
                                      DataType.INT64, DataType.BOOL, DataType.UINT8])
def test_buffers_round_trip_every_plan_type(datatype: DataType) -> None:
    pytest.importorskip("torch")
    array = (np.arange(12).reshape(3, 4) % 3).astype(datatype.numpy_dtype)
    array.flags.writeable = False  # request tensors arrive as read-only views; torch must not warn
    back = to_numpy(to_torch(array, "cpu"))
    assert back.dtype == datatype.numpy_dtype
    np.testing.assert_array_equal(back, array)
    np.testing.assert_array_equal(to_numpy(to_torch(array.T, "cpu")), array.T)  # non-contiguous input


# --- with TensorRT and a CUDA GPU ---------------------------------------------------------------------------


@pytest.fixture
def tensorrt_gpu() -> Any:
    trt = pytest.importorskip("tensorrt", reason="TensorRT is not installed")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    return trt


def _mlp(dtype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weights = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w")
    bias = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"], name="matmul"),
             helper.make_node("Add", ["xw", "b"], ["xwb"], name="add"),
             helper.make_node("Relu", ["xwb"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", dtype, ["batch", 8])],
                              [helper.make_tensor_value_info("y", dtype, ["batch", 4])], [weights, bias])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _built(tmp_path: Path, precision: str, config: str = CONFIG) -> tuple[Path, Path]:
    from kiln.build.tensorrt import build_plan

    onnx_path = tmp_path / "mlp.onnx"
    onnx.save(_mlp(), str(onnx_path))
    folder = write_model(tmp_path / "repo", "m", None, config)
    build_plan(onnx_path, folder / "1" / "model.plan", precision=precision, max_batch_size=8,
               workspace_bytes=1 << 28)
    return onnx_path, folder


@pytest.mark.gpu
@pytest.mark.parametrize(("precision", "tolerance"), [("fp32", 1e-4), ("fp16", 2e-2)])
def test_built_plan_agrees_with_onnxruntime(tmp_path: Path, tensorrt_gpu: Any, precision: str,
                                            tolerance: float) -> None:
    import onnxruntime as ort

    onnx_path, folder = _built(tmp_path, precision)
    model_dir = open_model_dir(folder)
    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    expected = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    with create_engine(model_dir.spec, model_dir.model_file(1), EngineOptions(kind="gpu")) as engine:
        assert engine.thread_safe is False
        for batch in (1, 5):
            out = engine.infer({"x": x[:batch]})["y"]
            assert out.dtype == np.float32 and out.shape == (batch, 4)
            np.testing.assert_allclose(out, expected[:batch], rtol=tolerance, atol=tolerance)
    with pytest.raises(UnavailableError, match="the engine is closed"):
        engine.execute({"x": x}, ["y"])


@pytest.mark.gpu
def test_config_that_disagrees_with_the_plan_fails_at_load(tmp_path: Path, tensorrt_gpu: Any) -> None:
    _, folder = _built(tmp_path, "fp32", CONFIG.replace('name: "y" data_type: TYPE_FP32', 'name: "y" '
                                                        'data_type: TYPE_FP16'))
    model_dir = open_model_dir(folder)
    with pytest.raises(ConfigError, match="output 'y' is TYPE_FP16 in the config but FLOAT"):
        create_engine(model_dir.spec, model_dir.model_file(1), EngineOptions(kind="gpu"))


@pytest.mark.gpu
def test_a_file_that_is_no_plan_fails_at_load(tmp_path: Path, tensorrt_gpu: Any) -> None:
    spec = _spec(tmp_path)
    with pytest.raises(ConfigError, match="cannot deserialize"):
        create_engine(spec, tmp_path / "m" / "1" / "model.plan", EngineOptions(kind="gpu"))


@pytest.mark.gpu
def test_a_batch_beyond_the_profile_is_refused(tmp_path: Path, tensorrt_gpu: Any) -> None:
    _, folder = _built(tmp_path, "fp32")
    model_dir = open_model_dir(folder)
    with create_engine(model_dir.spec, model_dir.model_file(1), EngineOptions(kind="gpu")) as engine:
        with pytest.raises(InvalidArgumentError, match=r"input 'x' has shape \[9, 8\] for the plan; it accepts "
                                                       r"\[1, 8\] to \[8, 8\]"):
            engine.execute({"x": np.zeros((9, 8), np.float32)}, ["y"])
