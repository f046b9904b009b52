"""kiln build with the onnxruntime backend: optimize, FP16, INT8; verification; publishing; pre-flight."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.build import BuildOptions, VerificationError, build
from kiln.build.progress import Progress
from kiln.cli import main
from kiln.demo.models import build_mlp
from kiln.errors import AlreadyExistsError, InvalidArgumentError, UnsupportedError
from kiln.testing.models import small_cnn


@pytest.fixture
def mlp_file(tmp_path: Path) -> Path:
    path = tmp_path / "mlp.onnx"
    onnx.save(build_mlp(0), str(path))
    return path


@pytest.fixture
def cnn_file(tmp_path: Path) -> Path:
    path = tmp_path / "cnn.onnx"
    onnx.save(small_cnn(), str(path))
    return path


def quiet(**fields: object) -> BuildOptions:
    return BuildOptions(progress=False, **fields)  # type: ignore[arg-type]


def test_fp32_build_publishes_a_verified_version_that_serves(mlp_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "repo" / "mlp"
    report = build(mlp_file, out, quiet())
    assert report.passed and report.version == 1
    assert sorted(p.name for p in (out / "1").iterdir()) == ["build_report.json", "model.onnx"]
    saved = json.loads((out / "1" / "build_report.json").read_text())
    assert saved["passed"] is True and saved["precision"] == "fp32" and saved["accuracy"]["samples"] == 32
    assert {t["batch_size"] for t in saved["speed"]} == {1, 8}
    assert "optimize" in saved["timings_s"]
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    with kiln.load(out) as built, kiln.load(mlp_file) as reference:
        assert built.spec.max_batch_size == 8
        np.testing.assert_allclose(built.infer({"INPUT0": x})["OUTPUT0"], reference.infer({"INPUT0": x})["OUTPUT0"],
                                   rtol=1e-5, atol=1e-5)
    assert not list((tmp_path / "repo").glob(".kiln-build-*")), "the staging folder is removed"


def test_next_build_is_the_next_version_and_keeps_the_config(mlp_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "mlp"
    build(mlp_file, out, quiet(max_batch_size=4))
    config = (out / "config.pbtxt").read_text()
    report = build(mlp_file, out, quiet(max_batch_size=16))
    assert report.version == 2
    assert (out / "config.pbtxt").read_text() == config, "an existing config is the user's: kept"
    with pytest.raises(AlreadyExistsError, match="already exists"):
        build(mlp_file, out, quiet(version=1))


def test_int8_build_fuses_into_integer_kernels_and_keeps_top1(cnn_file: Path, tmp_path: Path) -> None:
    data = tmp_path / "calib.npz"
    np.savez(data, x=np.random.default_rng(3).standard_normal((24, 3, 16, 16)).astype(np.float32))
    report = build(cnn_file, tmp_path / "cnn", quiet(precision="int8", calibration_data=data, min_top1=0.75))
    quant = report.details["quantization"]
    assert quant["format"] == "QDQ" and quant["per_channel"] is True and quant["calibration_batches"] == 3
    ops = report.details["runtime_ops"]
    assert ops.get("QLinearConv", 0) == 2 and "Conv" not in ops, ops
    assert report.accuracy is not None and report.accuracy.samples == 24
    top1 = report.accuracy.outputs[0].top1_agreement
    assert top1 is not None and top1 >= 0.75
    assert not any("random samples" in w for w in report.warnings)


@pytest.mark.parametrize("method", ["entropy", "percentile"])
def test_other_calibration_methods(cnn_file: Path, tmp_path: Path, method: str) -> None:
    report = build(cnn_file, tmp_path / "cnn", quiet(precision="int8", calibration_method=method, samples=8,
                                                     min_top1=0.0))
    assert report.details["quantization"]["calibration_method"] == method
    assert any("random samples" in w for w in report.warnings)


def test_fp16_keeps_fp32_io_and_warns_on_cpu(mlp_file: Path, tmp_path: Path) -> None:
    report = build(mlp_file, tmp_path / "mlp", quiet(precision="fp16"))
    model = onnx.load(str(tmp_path / "mlp" / "1" / "model.onnx"))
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert any(init.data_type == TensorProto.FLOAT16 for init in model.graph.initializer)
    assert any("FP16 does not speed up" in w for w in report.warnings)


def test_a_missed_tolerance_fails_and_publishes_nothing(cnn_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "cnn"
    with pytest.raises(VerificationError, match="exceed atol=1e-09") as failure:
        build(cnn_file, out, quiet(precision="int8", samples=8, atol=1e-9, rtol=0.0, min_top1=0.0))
    assert failure.value.report.passed is False
    assert not out.exists()
    assert not list(tmp_path.glob(".kiln-build-*"))


def test_preflight_lists_every_unsupported_node(tmp_path: Path) -> None:
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="ok"),
             helper.make_node("Frobnicate", ["a"], ["b"], name="custom_1", domain="acme.ops"),
             helper.make_node("NotAnOp", ["b"], ["y"], name="bogus_2")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    path = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                      helper.make_opsetid("acme.ops", 1)]), str(path))
    with pytest.raises(UnsupportedError) as failure:
        build(path, tmp_path / "bad", quiet())
    message = str(failure.value)
    assert "2 node(s)" in message and "acme.ops::Frobnicate (node 'custom_1')" in message
    assert "NotAnOp (node 'bogus_2')" in message
    assert not (tmp_path / "bad").exists()


def test_bf16_is_refused_for_onnxruntime(mlp_file: Path, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedError, match="bf16 is not available for the onnxruntime backend"):
        build(mlp_file, tmp_path / "mlp", quiet(precision="bf16"))


def test_calibration_data_errors_name_file_input_and_shape(mlp_file: Path, tmp_path: Path) -> None:
    wrong_name = tmp_path / "a.npz"
    np.savez(wrong_name, other=np.zeros((2, 64), np.float32))
    with pytest.raises(InvalidArgumentError, match=r"a.npz: no array for input\(s\) INPUT0; the file holds other"):
        build(mlp_file, tmp_path / "m", quiet(calibration_data=wrong_name))
    wrong_shape = tmp_path / "b.npz"
    np.savez(wrong_shape, INPUT0=np.zeros((2, 63), np.float32))
    with pytest.raises(InvalidArgumentError, match=r"'INPUT0' has shape \[2, 63\]; expected \[samples, 64\]"):
        build(mlp_file, tmp_path / "m", quiet(calibration_data=wrong_shape))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InvalidArgumentError, match="the folder has no .npz files"):
        build(mlp_file, tmp_path / "m", quiet(calibration_data=empty))


def test_calibration_folder_is_concatenated(mlp_file: Path, tmp_path: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    for i in range(3):
        np.savez(folder / f"part{i}.npz", INPUT0=np.full((2, 64), i, np.float32))
    report = build(mlp_file, tmp_path / "m", quiet(calibration_data=folder))
    assert report.accuracy is not None and report.accuracy.samples == 6


def test_max_batch_size_needs_a_dynamic_batch_dimension(tmp_path: Path) -> None:
    model = build_mlp(0)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 1
    path = tmp_path / "fixed.onnx"
    onnx.save(model, str(path))
    with pytest.raises(InvalidArgumentError, match=r"needs a dynamic first dimension.*INPUT0 \[1, 64\]"):
        build(path, tmp_path / "fixed", quiet(max_batch_size=4))
    report = build(path, tmp_path / "fixed", quiet())
    assert report.passed and [t.batch_size for t in report.speed] == [1]


def test_progress_prints_one_line_per_step_when_not_a_terminal() -> None:
    stream = io.StringIO()
    progress = Progress(stream=stream)
    with progress.step("calibrate", "calibrating", total=3) as advance:
        advance(1)
    assert stream.getvalue().splitlines()[0] == "kiln build: calibrating ..."
    assert stream.getvalue().splitlines()[1].startswith("kiln build: calibrating: done in ")
    assert "calibrate" in progress.timings


def test_cli_builds_and_reports(mlp_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "repo" / "mlp"
    assert main(["build", str(mlp_file), "--output", str(out), "--quiet", "--max-batch-size", "4"]) == 0
    printed = capsys.readouterr().out
    assert f"built: mlp version 1 (onnxruntime, fp32) -> {out / '1'}" in printed and "batch 4:" in printed
    assert main(["build", str(mlp_file), "-o", str(out), "--quiet", "--precision", "int8", "--atol", "1e-9",
                 "--rtol", "0", "--min-top1", "0"]) == 1
    captured = capsys.readouterr()
    assert "FAILED: mlp version 2" in captured.err and "kiln: error: mlp: the built engine failed" in captured.err


def test_tensorrt_needs_the_gpu_and_tensorrt(mlp_file: Path, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedError, match="use --device cuda"):
        build(mlp_file, tmp_path / "m", BuildOptions(backend="tensorrt", progress=False))
    with pytest.raises(UnsupportedError, match="'percentile' is not available with TensorRT"):
        build(mlp_file, tmp_path / "m", BuildOptions(backend="tensorrt", device="cuda", precision="int8",
                                                     calibration_method="percentile", progress=False))


def test_tensorrt_calibration_batches_have_the_opt_batch_size() -> None:
    from kiln.build.shapes import ShapeRange
    from kiln.build.tensorrt_backend import opt_batches

    samples = {"x": np.arange(10, dtype=np.float32).reshape(10, 1)}
    ranges = {"x": ShapeRange((1, 1), (4, 1), (8, 1))}
    got = [b["x"][:, 0].tolist() for b in opt_batches(samples, ranges)]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7]]
    few = [b["x"][:, 0].tolist() for b in opt_batches({"x": samples["x"][:3]}, ranges)]
    assert few == [[0, 1, 2, 0]]


def test_kiln_build_is_callable_with_keyword_options(mlp_file: Path, tmp_path: Path) -> None:
    import kiln.build

    report = kiln.build(mlp_file, tmp_path / "mlp", precision="fp16", progress=False)
    assert report.precision == "fp16" and report.passed
    with pytest.raises(InvalidArgumentError, match="unknown build option\\(s\\) precison"):
        kiln.build(mlp_file, tmp_path / "mlp", precison="fp16")
    with pytest.raises(InvalidArgumentError, match="not both"):
        kiln.build(mlp_file, tmp_path / "mlp", BuildOptions(), precision="fp16")


def test_shapes_give_dynamic_dimensions_for_generated_samples(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "seq",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "L"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "L"])])
    path = tmp_path / "seq.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(InvalidArgumentError, match=r"input 'x' has dynamic dimensions \[-1, -1\]; give its shape "
                                                   r"with --shapes"):
        build(path, tmp_path / "seq", quiet())
    assert main(["build", str(path), "-o", str(tmp_path / "seq"), "--quiet",
                 "--shapes", "x:1x4/2x8/4x16"]) == 0
    saved = json.loads((tmp_path / "seq" / "1" / "build_report.json").read_text())
    assert saved["passed"] and saved["accuracy"]["samples"] == 32
    capsys.readouterr()


def _one_op_model(path: Path, nodes: list[onnx.NodeProto]) -> Path:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 4])],
                              [helper.make_tensor("k", TensorProto.FLOAT, [], [1.5])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_outputs_no_top1_covers_are_judged_by_normalized_rms_error_and_nan_always_fails(tmp_path: Path) -> None:
    from kiln.build.calibration import generate_samples
    from kiln.build.verify import DEFAULT_TOLERANCES, compare
    from kiln.config.onnx_io import read_onnx_io

    relu = _one_op_model(tmp_path / "relu.onnx", [helper.make_node("Relu", ["x"], ["y"])])
    scaled = _one_op_model(tmp_path / "scaled.onnx", [helper.make_node("Relu", ["x"], ["r"]),
                                                       helper.make_node("Mul", ["r", "k"], ["y"])])
    nan = _one_op_model(tmp_path / "nan.onnx", [helper.make_node("Abs", ["x"], ["a"]),
                                                 helper.make_node("Neg", ["a"], ["n"]),
                                                 helper.make_node("Log", ["n"], ["y"])])
    samples = generate_samples(read_onnx_io(relu).inputs, 8, {}, seed=0)
    int8 = DEFAULT_TOLERANCES["int8"]
    with kiln.load(relu) as reference, kiln.load(relu) as same, kiln.load(scaled) as off, kiln.load(nan) as broken:
        assert compare(reference, same, samples, 4, int8).passed
        failed = compare(reference, off, samples, 4, int8)
        assert not failed.passed and "normalized RMS error" in failed.failures[0]
        assert failed.outputs[0].top1_agreement is None and failed.outputs[0].nrmse > 0.1
        nan_result = compare(reference, broken, samples, 4, DEFAULT_TOLERANCES["fp32"])
        assert "NaN or infinite where the reference is finite" in nan_result.failures[0]


def test_an_existing_config_must_fit_the_build(mlp_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "mlp"
    build(mlp_file, out, quiet())
    with pytest.raises(InvalidArgumentError, match="does not fit this build: backend is 'onnxruntime', the build "
                                                   "made 'pytorch'"):
        build(mlp_file, out, quiet(backend="torch"))
    assert sorted(p.name for p in out.iterdir()) == ["1", "config.pbtxt"], "nothing was published"
