"""kiln build --backend torch: ONNX -> kiln's converter -> TorchScript / torch.export / AOTInductor, verified."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.build import BuildOptions, build
from kiln.cli import main
from kiln.demo.models import build_mlp
from kiln.errors import InvalidArgumentError, UnsupportedError
from kiln.testing.models import small_cnn

torch = pytest.importorskip("torch")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def cnn_file(tmp_path: Path) -> Path:
    path = tmp_path / "cnn.onnx"
    onnx.save(small_cnn(), str(path))
    return path


def quiet(**fields: object) -> BuildOptions:
    return BuildOptions(backend="torch", progress=False, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("torch_format", "filename", "platform"),
                         [("torchscript", "model.pt", "pytorch_libtorch"), ("export", "model.pt2", "torch_aoti")])
def test_fp32_build_matches_onnxruntime_and_loads(cnn_file: Path, tmp_path: Path, torch_format: str,
                                                  filename: str, platform: str) -> None:
    out = tmp_path / "repo" / "cnn"
    report = build(cnn_file, out, quiet(torch_format=torch_format))
    assert report.passed and (out / "1" / filename).is_file()
    assert report.details["torch"]["format"] == torch_format
    x = np.random.default_rng(5).standard_normal((5, 3, 16, 16)).astype(np.float32)
    with kiln.load(out) as built, kiln.load(cnn_file) as reference:
        assert built.spec.platform == platform and built.spec.max_batch_size == 8
        np.testing.assert_allclose(built.infer({"x": x})["logits"], reference.infer({"x": x})["logits"],
                                   rtol=1e-4, atol=1e-5)


def test_bf16_build_writes_the_precision_parameter_and_meets_its_tolerance(tmp_path: Path) -> None:
    source = tmp_path / "mlp.onnx"
    onnx.save(build_mlp(0), str(source))
    out = tmp_path / "mlp"
    report = build(source, out, quiet(precision="bf16"))
    assert report.passed and report.accuracy is not None
    assert 0 < report.accuracy.outputs[0].max_abs_error < 5e-2, "bf16 differs from fp32, within tolerance"
    assert 'key: "precision"' in (out / "config.pbtxt").read_text()
    saved = json.loads((out / "1" / "build_report.json").read_text())
    assert saved["details"]["torch"]["parameters"] == {"precision": "bf16"}


def test_bf16_io_build_declares_bf16_tensors_and_serves_them(tmp_path: Path) -> None:
    source = tmp_path / "mlp.onnx"
    onnx.save(build_mlp(0), str(source))
    out = tmp_path / "mlp"
    report = build(source, out, quiet(precision="bf16", io_dtype="bf16"))
    assert report.passed and report.accuracy is not None
    assert 0 < report.accuracy.outputs[0].max_abs_error < 5e-2, "verified against FP32, within bf16 tolerance"
    config = (out / "config.pbtxt").read_text()
    assert config.count("TYPE_BF16") == 2 and "TYPE_FP32" not in config
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    with kiln.load(out) as built, kiln.load(source) as reference:
        with pytest.raises(InvalidArgumentError, match="expected BF16"):
            built.infer({"INPUT0": x})  # the config now asks for bf16
        got = built.infer({"INPUT0": x.astype(ml_dtypes.bfloat16)})["OUTPUT0"]
        assert got.dtype == ml_dtypes.bfloat16 and got.shape == (4, 10)
        np.testing.assert_allclose(got.astype(np.float32), reference.infer({"INPUT0": x})["OUTPUT0"],
                                   atol=0.1, rtol=0.05)


@pytest.mark.parametrize(("fields", "error", "message"), [
    ({"io_dtype": "fp16", "precision": "fp32"}, InvalidArgumentError, "needs --precision fp16"),
    ({"io_dtype": "bf16", "precision": "bf16", "backend": "onnxruntime"}, UnsupportedError,
     "torch backend only, not 'onnxruntime'"),
    ({"io_dtype": "fp8"}, InvalidArgumentError, "expected one of model, fp16, bf16"),
])
def test_io_dtype_refusals_name_the_option(cnn_file: Path, tmp_path: Path, fields: dict[str, object],
                                           error: type[Exception], message: str) -> None:
    options = BuildOptions(**{"backend": "torch", "progress": False, **fields})  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        build(cnn_file, tmp_path / "cnn", options)
    assert not (tmp_path / "cnn").exists()


@pytest.mark.parametrize(("fields", "message"), [
    ({"precision": "int8"}, "int8 is not available for the torch backend"),
    ({"precision": "fp16"}, "fp16 with the torch backend needs --device cuda"),
    ({"cuda_graphs": True}, "--cuda-graphs needs --device cuda"),
])
def test_refused_combinations(cnn_file: Path, tmp_path: Path, fields: dict[str, object], message: str) -> None:
    with pytest.raises(UnsupportedError, match=message):
        build(cnn_file, tmp_path / "cnn", quiet(**fields))
    assert not (tmp_path / "cnn").exists()


def test_preflight_names_the_nodes_the_converter_cannot_run(tmp_path: Path) -> None:
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="fine"),
             helper.make_node("NonMaxSuppression", ["a", "a"], ["b"], name="nms_1"),
             helper.make_node("TopK", ["b", "k"], ["y", "i"], name="topk_2", axis=-1)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2]),
         helper.make_tensor_value_info("i", TensorProto.INT64, ["N", 2])],
        [helper.make_tensor("k", TensorProto.INT64, [1], [2])])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(UnsupportedError) as failure:
        build(path, tmp_path / "m", quiet())
    message = str(failure.value)
    assert "the torch backend cannot run 2 node(s)" in message
    assert "NonMaxSuppression (node 'nms_1')" in message and "TopK (node 'topk_2')" in message


def test_cli_torch_build(cnn_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cnn"
    assert main(["build", str(cnn_file), "-o", str(out), "--backend", "torch", "--quiet", "--max-batch-size", "4"]) == 0
    assert "built: cnn version 1 (torch, fp32)" in capsys.readouterr().out
    assert (out / "1" / "model.pt2").is_file()


@pytest.mark.slow
def test_aoti_package_on_cpu(cnn_file: Path, tmp_path: Path) -> None:
    report = build(cnn_file, tmp_path / "cnn", quiet(torch_format="aoti", max_batch_size=4))
    assert report.passed and (tmp_path / "cnn" / "1" / "model.pt2").is_file()


@pytest.mark.gpu
@needs_cuda
def test_fp16_cuda_graph_build_on_gpu(cnn_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "cnn"
    report = build(cnn_file, out, quiet(precision="fp16", device="cuda", torch_format="export", channels_last=True,
                                        compile_mode="default", max_batch_size=16))
    assert report.passed
    parameters = report.details["torch"]["parameters"]
    assert parameters == {"precision": "fp16", "channels_last": "true", "cuda_graphs": "true",
                          "cuda_graph_batch_sizes": "1-16", "compile_mode": "default"}
    assert {t.batch_size for t in report.speed} == {1, 16}
    compiled = report.details["compile"]
    assert (out / "1" / compiled["cache"]["file"]).is_file()
    fresh = compiled["cache"]["fresh_process"]  # an empty Inductor cache: every graph from compile_cache.bin
    assert fresh["cache"] == "loaded" and fresh["fx_graph_hits"] == 2 and fresh["fx_graph_misses"] == 0
    assert compiled["load_s"]["compiled_cold"] > 0 and compiled["load_s"]["compiled_cached"] > 0
    assert_gpu_limit(report.details["gpu_limit"], [2, 8])  # the preferred batch sizes of max 16


def assert_gpu_limit(limit: dict[str, object], batch_sizes: list[int]) -> None:
    figures = limit["figures"]
    assert isinstance(figures, list)
    assert [(f["batch_size"], f["streams"]) for f in figures] == [(b, s) for b in batch_sizes for s in (1, 2)]
    assert all(f["rows_per_s"] > 0 and f["ms_per_batch"] > 0 for f in figures)


@pytest.mark.gpu
@needs_cuda
def test_auto_on_gpu_times_eager_and_compiled_and_keeps_the_faster(cnn_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "cnn"
    report = build(cnn_file, out, quiet(precision="fp16", device="cuda", channels_last=True, max_batch_size=16))
    assert report.passed
    compiled = report.details["compile"]
    assert compiled["requested"] == "auto" and compiled["decided_by"].startswith("measured")
    timings = compiled["timings"]
    assert [t["batch_size"] for t in timings] == [2, 8]  # the config's preferred batch sizes
    faster = sum(t["compiled_ms"] for t in timings) <= 0.95 * sum(t["eager_ms"] for t in timings)
    assert compiled["mode"] == ("default" if faster else "none")
    assert report.details["torch"]["parameters"].get("compile_mode", "none") == compiled["mode"]
    assert (out / "1" / "compile_cache.bin").is_file() == faster
    assert_gpu_limit(report.details["gpu_limit"], [2, 8])
    assert "GPU limit (rows/s" in report.summary()


@pytest.mark.gpu
@needs_cuda
def test_fp16_io_graph_build_on_gpu_takes_and_returns_fp16(cnn_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "cnn"
    report = build(cnn_file, out, quiet(precision="fp16", io_dtype="fp16", device="cuda", max_batch_size=8))
    assert report.passed
    memory = report.details["gpu_memory"]  # measured while verifying; decides the config's instance count
    assert memory["engine_mib"] > 0 and memory["gpu_total_mib"] > memory["engine_mib"]
    assert f"count: {memory['instances']}" in (out / "config.pbtxt").read_text()
    x = np.random.default_rng(2).standard_normal((3, 3, 16, 16)).astype(np.float32)
    with kiln.load(out) as built, kiln.load(cnn_file) as reference:
        got = built.infer({"x": x.astype(np.float16)})["logits"]
        assert got.dtype == np.float16
        np.testing.assert_allclose(got.astype(np.float32), reference.infer({"x": x})["logits"], atol=0.05,
                                   rtol=0.05)


@pytest.mark.gpu
@needs_cuda
def test_aoti_fp16_package_on_gpu(cnn_file: Path, tmp_path: Path) -> None:
    report = build(cnn_file, tmp_path / "cnn", quiet(precision="fp16", device="cuda", torch_format="aoti",
                                                     cuda_graphs=False, max_batch_size=8))
    assert report.passed


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU())
        self.head_a = torch.nn.Linear(16, 3)
        self.head_b = torch.nn.Linear(16, 2)

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.body(features)
        return self.head_a(hidden), self.head_b(hidden)


def test_build_from_a_torch_module_with_example_inputs(tmp_path: Path) -> None:
    import kiln.build

    torch.manual_seed(0)
    module = TwoHeads()
    out = tmp_path / "heads"
    report = kiln.build(module, out, example_inputs=(torch.randn(2, 6),), backend="torch", max_batch_size=4,
                        progress=False)
    assert report.passed and report.source == "torch module TwoHeads"
    assert report.steps[0] == "torch module -> torch.export program (model.pt2)"
    x = np.random.default_rng(2).standard_normal((3, 6)).astype(np.float32)
    with kiln.load(out) as built, torch.no_grad():
        assert [t.name for t in built.inputs] == ["features"]
        assert [t.name for t in built.outputs] == ["output__0", "output__1"]
        got = built.infer({"features": x})
        want_a, want_b = module(torch.from_numpy(x))
        np.testing.assert_allclose(got["output__0"], want_a.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["output__1"], want_b.numpy(), rtol=1e-5, atol=1e-6)


def test_module_sources_need_examples_and_the_torch_backend(tmp_path: Path) -> None:
    import kiln.build
    from kiln.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="needs example_inputs"):
        kiln.build(TwoHeads(), tmp_path / "m", backend="torch", progress=False)
    with pytest.raises(InvalidArgumentError, match="builds with backend 'torch', not 'onnxruntime'"):
        kiln.build(TwoHeads(), tmp_path / "m", example_inputs=torch.randn(2, 6), progress=False)


def test_max_batch_size_one_still_exports_a_dynamic_first_dimension(cnn_file: Path, tmp_path: Path) -> None:
    report = build(cnn_file, tmp_path / "cnn", quiet(max_batch_size=1))
    assert report.passed
    report0 = build(cnn_file, tmp_path / "cnn0", quiet(max_batch_size=0))
    assert report0.passed
    x = np.zeros((3, 3, 16, 16), np.float32)
    with kiln.load(tmp_path / "cnn0") as built:  # no batching: the first dimension is -1 in the config and in the file
        assert built.infer({"x": x})["logits"].shape == (3, 10)


@pytest.mark.parametrize(("fields", "message"), [
    ({"torch_format": "aoti", "compile_mode": "default"}, "--torch-format aoti compiles the model ahead of time"),
    ({"torch_format": "torchscript", "compile_mode": "default"}, "torch.compile does not take TorchScript"),
    ({"compile_mode": "fastest"}, "--compile-mode is 'fastest'"),
])
def test_format_options_the_engine_would_refuse_fail_before_building(cnn_file: Path, tmp_path: Path,
                                                                     fields: dict[str, object], message: str) -> None:
    from kiln.errors import InvalidArgumentError

    with pytest.raises((UnsupportedError, InvalidArgumentError), match=message):
        build(cnn_file, tmp_path / "cnn", quiet(**fields))
