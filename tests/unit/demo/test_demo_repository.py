"""The demo model repository: layout, determinism, and that each model computes what it claims."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from google.protobuf import text_format
from onnx import numpy_helper

from kiln.demo import build_demo_repository
from kiln.demo.resnet import build_resnet50

ONNX_DEMOS = ["simple", "mlp"]
PIPELINE = ["mlp_preprocess", "mlp_postprocess", "mlp_pipeline"]
TRITON_EXAMPLES = ["simple_int8", "simple_sequence", "simple_dyna_sequence"]  # ONNX, for Triton's example clients
DEMO_NAMES = [*ONNX_DEMOS, "simple_string", *PIPELINE, *TRITON_EXAMPLES, "simple_identity",
              "simple_string_dyna_sequence", "repeat_int32", "image_classifier"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("demo")
    build_demo_repository(root)
    return root


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _session(model: Path | onnx.ModelProto) -> ort.InferenceSession:
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"])


def _initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_layout_and_names(tmp_path: Path) -> None:
    root = tmp_path / "models"  # does not exist yet: the builder creates it
    assert build_demo_repository(root) == DEMO_NAMES
    onnx_files, python_files = ("config.pbtxt", "1/model.onnx"), ("config.pbtxt", "1/model.py")
    expected = {f"{name}/{leaf}" for name in [*ONNX_DEMOS, *TRITON_EXAMPLES] for leaf in onnx_files}
    expected |= {f"{name}/{leaf}" for name in ("simple_string", "simple_identity", "simple_string_dyna_sequence",
                                               "repeat_int32") for leaf in python_files}
    expected |= {f"{name}/{leaf}" for name in PIPELINE[:2] for leaf in ("config.pbtxt", "1/model.py")}
    expected |= {"mlp_pipeline/config.pbtxt"}  # its version folder 1/ holds no file
    expected |= {f"image_classifier/{leaf}" for leaf in (*onnx_files, "labels.txt")}
    assert (root / "mlp_pipeline" / "1").is_dir()
    assert set(_files(root)) == expected  # and no temp files left behind
    for name in [*ONNX_DEMOS, *TRITON_EXAMPLES]:
        model = onnx.load(root / name / "1" / "model.onnx")
        onnx.checker.check_model(model)
        assert (model.producer_name, model.producer_version, model.ir_version) == ("kiln-demo", "1", 8)
        assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
        assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"


def test_rebuild_overwrites_owned_files_only(tmp_path: Path) -> None:
    build_demo_repository(tmp_path)
    pristine = _files(tmp_path)
    (tmp_path / "mlp" / "1" / "model.onnx").write_bytes(b"half a file")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.pbtxt").write_text('name: "mine"\n')
    assert build_demo_repository(tmp_path) == DEMO_NAMES
    after = _files(tmp_path)
    assert after.pop("mine/config.pbtxt") == b'name: "mine"\n'
    assert after == pristine


def test_same_seed_is_byte_identical(tmp_path: Path) -> None:
    build_demo_repository(tmp_path / "a", seed=7)
    build_demo_repository(tmp_path / "b", seed=7)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


def test_different_seed_changes_mlp_weights(tmp_path: Path) -> None:
    build_demo_repository(tmp_path / "a", seed=0)
    build_demo_repository(tmp_path / "b", seed=1)
    mlp_a = _initializers(onnx.load(tmp_path / "a" / "mlp" / "1" / "model.onnx"))
    mlp_b = _initializers(onnx.load(tmp_path / "b" / "mlp" / "1" / "model.onnx"))
    assert mlp_a.keys() == mlp_b.keys()
    assert all(not np.array_equal(mlp_a[k], mlp_b[k]) for k in mlp_a)
    # No weights in `simple`, so nothing there depends on the seed.
    assert _files(tmp_path / "a" / "simple") == _files(tmp_path / "b" / "simple")


def test_negative_seed_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="seed"):
        build_demo_repository(tmp_path, seed=-1)


def test_simple_adds_and_subtracts(repo: Path) -> None:
    rng = np.random.default_rng(42)
    # Bounded so a + b and a - b cannot overflow int32.
    a, b = (rng.integers(-(2**30), 2**30, size=(3, 16), dtype=np.int32) for _ in range(2))
    out0, out1 = _session(repo / "simple" / "1" / "model.onnx").run(["OUTPUT0", "OUTPUT1"], {"INPUT0": a, "INPUT1": b})
    assert out0.dtype == out1.dtype == np.int32
    np.testing.assert_array_equal(out0, a + b)
    np.testing.assert_array_equal(out1, a - b)


def test_mlp_matches_numpy(repo: Path) -> None:
    path = repo / "mlp" / "1" / "model.onnx"
    model = onnx.load(path)
    params = _initializers(model)
    x = np.random.default_rng(3).standard_normal((5, 64), dtype=np.float32)
    (got,) = _session(path).run(["OUTPUT0"], {"INPUT0": x})

    expected = x.astype(np.float64)
    gemms = [n for n in model.graph.node if n.op_type == "Gemm"]
    assert len(gemms) == 3
    for i, node in enumerate(gemms):
        _, weight, bias = node.input
        expected = expected @ params[weight].T + params[bias]
        if i < len(gemms) - 1:
            expected = np.maximum(expected, 0.0)
    assert got.shape == (5, 10)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "max_batch_size", "inputs"),
    [("simple", 8, [("INPUT0", [16]), ("INPUT1", [16])]), ("mlp", 32, [("INPUT0", [64])])],
)
def test_config_parses_as_model_config(
    repo: Path, name: str, max_batch_size: int, inputs: list[tuple[str, list[int]]]
) -> None:
    pb2 = pytest.importorskip("kiln.v2._generated.model_config_pb2")
    config = text_format.Parse((repo / name / "config.pbtxt").read_text(), pb2.ModelConfig())
    assert config.name == name
    assert config.platform == "onnxruntime_onnx"
    assert config.max_batch_size == max_batch_size
    assert [(i.name, list(i.dims)) for i in config.input] == inputs
    data_type = config.input[0].DESCRIPTOR.fields_by_name["data_type"].enum_type
    expected_type = "TYPE_INT32" if name == "simple" else "TYPE_FP32"
    assert {data_type.values_by_number[i.data_type].name for i in config.input} == {expected_type}
    assert config.HasField("dynamic_batching") == (name == "mlp")


def test_resnet50_architecture_at_reduced_width() -> None:
    model = build_resnet50(base_channels=8, image_size=64)
    onnx.checker.check_model(model, full_check=True)
    convs = {n.name: n for n in model.graph.node if n.op_type == "Conv"}
    assert len(convs) == 53  # 1 stem + 16 bottlenecks x 3 + 4 projection shortcuts

    def attr(name: str, key: str) -> list[int]:
        return list(next(a.ints for a in convs[name].attribute if a.name == key))

    strided = {name for name in convs if attr(name, "strides") == [2, 2]}
    downsampling = {f"layer{stage}.0.{conv}" for stage in (2, 3, 4) for conv in ("conv2", "downsample")}
    assert strided == {"conv1"} | downsampling  # v1.5: on the 3x3, never on the bottleneck's first 1x1
    assert all(attr(f"layer{stage}.0.conv2", "kernel_shape") == [3, 3] for stage in (2, 3, 4))

    x = np.random.default_rng(0).standard_normal((2, 3, 64, 64), dtype=np.float32)
    (out,) = _session(model).run(["output"], {"input": x})
    assert out.shape == (2, 1000)
    assert np.isfinite(out).all()


@pytest.mark.slow
def test_resnet50_full_size_runs(tmp_path: Path) -> None:
    assert build_demo_repository(tmp_path, include_resnet50=True) == [*DEMO_NAMES, "resnet50"]
    path = tmp_path / "resnet50" / "1" / "model.onnx"
    model = onnx.load(path)
    params = sum(int(np.prod(t.dims)) for t in model.graph.initializer)
    assert abs(params - 25_557_032) / 25_557_032 < 0.01
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224), dtype=np.float32)
    (out,) = _session(path).run(["output"], {"input": x})
    assert out.shape == (1, 1000)
    assert np.isfinite(out).all()
    assert "dynamic_batching { }" in (tmp_path / "resnet50" / "config.pbtxt").read_text()
