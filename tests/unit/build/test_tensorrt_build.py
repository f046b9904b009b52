"""The TensorRT builder.

Without TensorRT: option checks (percentile refused), Q/DQ detection, the errors raised before TensorRT is
needed, parser-error and unsupported-node reports over real ONNX graphs, and the calibration feed on CPU
buffers. With TensorRT and a CUDA GPU (``gpu`` marker): fp32/fp16/int8 builds, the timing cache, parser errors.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.build.shapes import ShapeRange
from kiln.build.tensorrt import (
    CalibrationFeed,
    ParserIssue,
    UnsupportedNode,
    build_plan,
    check_build_options,
    describe_parser_issues,
    has_qdq,
    nodes_outside,
    unsupported_nodes,
)
from kiln.errors import InternalError, InvalidArgumentError, UnavailableError, UnsupportedError


def _model(nodes: list[onnx.NodeProto], initializers: list[onnx.TensorProto] | None = None,
           opsets: tuple[tuple[str, int], ...] = (("", 17),)) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
                              initializers or [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = 8
    return model


def _mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    return _model([helper.make_node("MatMul", ["x", "w"], ["xw"], name="matmul"),
                   helper.make_node("Add", ["xw", "b"], ["xwb"], name="add"),
                   helper.make_node("Relu", ["xwb"], ["y"], name="relu")],
                  [numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w"),
                   numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")])


def _qdq() -> onnx.ModelProto:
    scale = numpy_helper.from_array(np.array(0.05, np.float32), "scale")
    zero = numpy_helper.from_array(np.array(0, np.int8), "zero")
    weights = numpy_helper.from_array(np.ones((8, 4), np.float32), "w")
    return _model([helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["xq"], name="q"),
                   helper.make_node("DequantizeLinear", ["xq", "scale", "zero"], ["xd"], name="dq"),
                   helper.make_node("MatMul", ["xd", "w"], ["y"], name="matmul")], [scale, zero, weights])


def _save(tmp_path: Path, model: onnx.ModelProto, name: str = "m.onnx") -> Path:
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize(("args", "error", "message"), [
    (("fp8", "entropy", 1, 3), InvalidArgumentError, "precision is 'fp8'; expected one of: fp32, fp16, bf16, int8"),
    (("int8", "percentile", 1, 3), UnsupportedError,
     "calibration method 'percentile' is not available with TensorRT: TensorRT 10 calibrates with entropy "
     "(IInt8EntropyCalibrator2) or minmax (IInt8MinMaxCalibrator); pick one of those, or build with --backend "
     "onnxruntime for percentile calibration"),
    (("int8", "kl", 1, 3), InvalidArgumentError, "calibration method is 'kl'; expected one of: entropy, minmax"),
    (("fp16", "entropy", 0, 3), InvalidArgumentError,
     "workspace_bytes is 0; expected a positive number of bytes"),
    (("fp16", "entropy", 1, 6), InvalidArgumentError,
     "optimization_level is 6; TensorRT accepts 0..5 (default 3)"),
])
def test_option_errors(args: tuple[str, str, int, int], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        check_build_options(*args)
    assert str(info.value) == message


def test_qdq_nodes_are_found_in_the_graph_and_its_subgraphs() -> None:
    assert not has_qdq(_mlp())
    assert has_qdq(_qdq())
    branch = helper.make_graph([helper.make_node("DequantizeLinear", ["q", "s"], ["o"])], "then", [],
                               [helper.make_tensor_value_info("o", TensorProto.FLOAT, [1])])
    wrapped = _model([helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)])
    assert has_qdq(wrapped)


def test_errors_before_tensorrt_is_needed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    plan = tmp_path / "model.plan"
    with pytest.raises(InvalidArgumentError, match=r"missing\.onnx: no such ONNX file$"):
        build_plan(tmp_path / "missing.onnx", plan)
    (tmp_path / "bad.onnx").write_bytes(b"\xff\x00 not protobuf")
    with pytest.raises(InvalidArgumentError, match=r"bad\.onnx: not a readable ONNX model"):
        build_plan(tmp_path / "bad.onnx", plan)
    qdq = _save(tmp_path, _qdq(), "qdq.onnx")
    with pytest.raises(InvalidArgumentError) as info:
        build_plan(qdq, plan, precision="fp16")
    assert str(info.value) == (
        f"{qdq} holds QuantizeLinear/DequantizeLinear nodes, so TensorRT builds it strongly typed and its precision "
        f"is the file's own; build it with precision 'int8', not 'fp16'")
    mlp = _save(tmp_path, _mlp())
    with pytest.raises(InvalidArgumentError) as info:
        build_plan(mlp, plan, precision="int8")
    assert str(info.value) == (f"INT8 for {mlp} needs calibration data (CLI: --calibration-data) or an existing "
                               f"calibration cache; without them TensorRT would use placeholder scales")
    with pytest.raises(UnsupportedError, match="'percentile' is not available with TensorRT"):
        build_plan(mlp, plan, precision="int8", calibration_method="percentile", calibration_batches=[])
    assert not plan.exists()


def test_without_tensorrt_building_and_the_preflight_are_unavailable(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    mlp = _save(tmp_path, _mlp())
    with pytest.raises(UnavailableError, match=r"install it with pip install 'kiln\[tensorrt\]'$"):
        build_plan(mlp, tmp_path / "model.plan", precision="fp16", max_batch_size=8)
    with pytest.raises(UnavailableError, match=r"install it with pip install 'kiln\[tensorrt\]'$"):
        unsupported_nodes(mlp)


def test_parser_errors_name_their_nodes() -> None:
    issues = [ParserIssue(1, "", "", "UNSUPPORTED_NODE", "no importer"),
              ParserIssue(2, "relu_named", "Relu", "INVALID_NODE", "bad attribute"),
              ParserIssue(-1, "", "", "MODEL_DESERIALIZE_FAILED", "truncated")]
    assert describe_parser_issues(Path("m.onnx"), _mlp(), issues) == (
        "TensorRT cannot parse m.onnx: 3 error(s): node 1 'add' (Add): UNSUPPORTED_NODE: no importer; "
        "node 2 'relu_named' (Relu): INVALID_NODE: bad attribute; the graph: MODEL_DESERIALIZE_FAILED: truncated")


def test_unsupported_nodes_are_the_failed_and_the_uncovered_ones() -> None:
    model = _mlp()
    model.graph.node[2].name = ""
    issues = [ParserIssue(1, "add", "Add", "UNSUPPORTED_NODE", "no importer for Add")]
    assert nodes_outside(model, [0, 1, 2], []) == []
    assert nodes_outside(model, [0, 2], issues) == [
        UnsupportedNode("Add", "add", "UNSUPPORTED_NODE: no importer for Add")]
    assert nodes_outside(model, [1], issues + [ParserIssue(-1, "", "", "INVALID_GRAPH", "bad input")]) == [
        UnsupportedNode("MatMul", "matmul", "reads a graph input that TensorRT rejected"),
        UnsupportedNode("Add", "add", "UNSUPPORTED_NODE: no importer for Add"),
        UnsupportedNode("Relu", "#2", "reads a graph input that TensorRT rejected"),
        UnsupportedNode("", "(graph)", "INVALID_GRAPH: bad input")]


def _read(pointer: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer((ctypes.c_char * size).from_address(pointer), dtype=dtype).reshape(shape).copy()


def test_calibration_feed_copies_each_batch_into_stable_buffers() -> None:
    pytest.importorskip("torch")
    batches = [{"x": np.full((2, 8), i, np.float32), "ids": np.arange(4, dtype=np.int32) + i} for i in range(3)]
    feed = CalibrationFeed(batches, {"x": ((2, 8), np.float32), "ids": ((4,), np.int32)}, "cpu")
    seen = []
    while (pointers := feed.next_pointers(["ids", "x"])) is not None:
        seen.append(pointers)
        np.testing.assert_array_equal(_read(pointers[1], (2, 8), np.float32), np.full((2, 8), len(seen) - 1))
        np.testing.assert_array_equal(_read(pointers[0], (4,), np.int32), np.arange(4) + len(seen) - 1)
    assert feed.count == 3 and feed.error is None
    assert seen[0] == seen[1] == seen[2]  # one device buffer per input, refilled


@pytest.mark.parametrize(("batch", "message"), [
    ({"x": np.zeros((2, 8), np.float64)}, "calibration batch 1: input 'x' has dtype float64; expected float32"),
    ({"x": np.zeros((3, 8), np.float32)}, "calibration batch 1: input 'x' has shape 3x8; expected 2x8 (the "
                                          "profile's opt shape, which TensorRT calibrates with)"),
    ({"image": np.zeros((2, 8), np.float32)}, "calibration batch 1 has input 'image', which the network does not "
                                              "have (inputs: x)"),
    ({}, "calibration batch 1 is missing input 'x' (it has: )"),
])
def test_calibration_feed_keeps_its_first_error(batch: dict[str, Any], message: str) -> None:
    pytest.importorskip("torch")
    feed = CalibrationFeed([batch, {"x": np.zeros((2, 8), np.float32)}], {"x": ((2, 8), np.float32)}, "cpu")
    assert feed.next_pointers(["x"]) is None
    assert isinstance(feed.error, InvalidArgumentError) and str(feed.error) == message
    assert feed.next_pointers(["x"]) is None and feed.count == 0  # calibration stays ended


def test_calibration_feed_turns_a_failing_data_source_into_an_error() -> None:
    pytest.importorskip("torch")

    def batches() -> Iterator[dict[str, np.ndarray]]:
        yield {"x": np.zeros((2, 8), np.float32)}
        raise OSError("disk gone")

    feed = CalibrationFeed(batches(), {"x": ((2, 8), np.float32)}, "cpu")
    assert feed.next_pointers(["x"]) is not None
    assert feed.next_pointers(["x"]) is None
    assert isinstance(feed.error, InternalError)
    assert str(feed.error) == "calibration batch 2 could not be read: OSError('disk gone')"


def test_calibration_cache_round_trip(tmp_path: Path) -> None:
    cache = tmp_path / "sub" / "calib.cache"
    feed = CalibrationFeed([], {}, "cpu", cache)
    assert feed.read_cache() is None
    feed.write_cache(memoryview(b"TRT-scales"))
    assert feed.read_cache() == b"TRT-scales" and cache.read_bytes() == b"TRT-scales"
    cache.write_bytes(b"")
    assert feed.read_cache() is None  # an empty cache means: calibrate
    assert CalibrationFeed([], {}, "cpu").read_cache() is None


# --- with TensorRT and a CUDA GPU ---------------------------------------------------------------------------


@pytest.fixture
def tensorrt_gpu() -> Any:
    trt = pytest.importorskip("tensorrt", reason="TensorRT is not installed")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    return trt


def _run_plan(plan: Path, x: np.ndarray) -> np.ndarray:
    from kiln.config import open_model_dir
    from kiln.engines import EngineOptions, create_engine
    from kiln.testing import write_model

    config = ('name: "m" backend: "tensorrt" max_batch_size: 8 input [{ name: "x" data_type: TYPE_FP32 dims: [8] }] '
              'output [{ name: "y" data_type: TYPE_FP32 dims: [4] }]')
    folder = write_model(plan.parent / "repo", "m", None, config)
    (folder / "1" / "model.plan").write_bytes(plan.read_bytes())
    model_dir = open_model_dir(folder)
    with create_engine(model_dir.spec, model_dir.model_file(1), EngineOptions(kind="gpu")) as engine:
        return engine.infer({"x": x})["y"]


@pytest.mark.gpu
def test_fp16_build_reports_what_it_did_and_reuses_the_timing_cache(tmp_path: Path, tensorrt_gpu: Any) -> None:
    mlp, cache = _save(tmp_path, _mlp()), tmp_path / "timing.cache"
    first = build_plan(mlp, tmp_path / "a.plan", precision="fp16", shapes={"x": ShapeRange((1, 8), (4, 8), (8, 8))},
                       timing_cache=cache, workspace_bytes=1 << 28)
    assert (first.precision, first.builder_flags, first.strongly_typed) == ("fp16", ("FP16",), False)
    assert first.profile == {"x": ShapeRange((1, 8), (4, 8), (8, 8))} and first.calibration == "none"
    assert first.plan_bytes == (tmp_path / "a.plan").stat().st_size > 0
    assert first.network_layers >= 3 and first.build_seconds > 0 and first.tensorrt_version.startswith("10.")
    assert cache.stat().st_size > 0 and not first.timing_cache_reused
    second = build_plan(mlp, tmp_path / "b.plan", precision="fp16", max_batch_size=8, timing_cache=cache,
                        workspace_bytes=1 << 28)
    assert second.timing_cache_reused and second.notes == ()


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["entropy", "minmax"])
def test_int8_calibration_builds_a_plan_close_to_fp32(tmp_path: Path, tensorrt_gpu: Any, method: str) -> None:
    import onnxruntime as ort

    mlp, cache = _save(tmp_path, _mlp()), tmp_path / "calib.cache"
    rng = np.random.default_rng(2)
    batches = [{"x": rng.standard_normal((8, 8)).astype(np.float32)} for _ in range(8)]
    info = build_plan(mlp, tmp_path / "int8.plan", precision="int8", max_batch_size=8, calibration_batches=batches,
                      calibration_method=method, calibration_cache=cache, workspace_bytes=1 << 28)
    assert (info.calibration, info.calibration_batches, info.builder_flags) == (method, 8, ("INT8",))
    assert cache.stat().st_size > 0
    x = batches[0]["x"]
    expected = ort.InferenceSession(str(mlp), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    out = _run_plan(tmp_path / "int8.plan", x)
    assert np.abs(out - expected).max() < 0.1 * np.abs(expected).max()
    again = build_plan(mlp, tmp_path / "again.plan", precision="int8", max_batch_size=8, calibration_cache=cache,
                       workspace_bytes=1 << 28)
    assert (again.calibration, again.calibration_batches) == ("cache", 0)


@pytest.mark.gpu
def test_int8_with_bad_calibration_data_names_the_problem(tmp_path: Path, tensorrt_gpu: Any) -> None:
    mlp = _save(tmp_path, _mlp())
    with pytest.raises(InvalidArgumentError, match="input 'x' has shape 2x8; expected 8x8"):
        build_plan(mlp, tmp_path / "int8.plan", precision="int8", max_batch_size=8,
                   calibration_batches=[{"x": np.zeros((2, 8), np.float32)}], workspace_bytes=1 << 28)
    with pytest.raises(InvalidArgumentError, match="received no batches"):
        build_plan(mlp, tmp_path / "int8.plan", precision="int8", max_batch_size=8, calibration_batches=[],
                   workspace_bytes=1 << 28)


@pytest.mark.gpu
def test_explicitly_quantized_model_builds_strongly_typed(tmp_path: Path, tensorrt_gpu: Any) -> None:
    info = build_plan(_save(tmp_path, _qdq()), tmp_path / "qdq.plan", precision="int8", max_batch_size=8,
                      calibration_batches=[], workspace_bytes=1 << 28)
    assert info.strongly_typed and info.builder_flags == () and info.calibration == "none"
    assert info.notes == ("calibration data unused: the model is explicitly quantized (Q/DQ nodes)",)


@pytest.mark.gpu
def test_unknown_operator_is_reported_by_the_parser(tmp_path: Path, tensorrt_gpu: Any) -> None:
    model = _model([helper.make_node("Relu", ["x"], ["r"], name="relu"),
                    helper.make_node("NoSuchOp", ["r"], ["y"], name="mystery", domain="kiln.test")],
                   opsets=(("", 17), ("kiln.test", 1)))
    path = _save(tmp_path, model)
    found = unsupported_nodes(path)
    assert [(n.op_type, n.node_name) for n in found] == [("NoSuchOp", "mystery")]
    assert unsupported_nodes(_save(tmp_path, _mlp(), "mlp.onnx")) == []
    with pytest.raises(UnsupportedError, match=r"TensorRT cannot parse .*node 1 'mystery' \(NoSuchOp\)"):
        build_plan(path, tmp_path / "x.plan", max_batch_size=8)
