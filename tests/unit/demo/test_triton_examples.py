"""The demo models Triton's example clients use: simple_int8, simple_sequence, simple_dyna_sequence (ONNX) and
simple_identity (Python): their configs as Triton's examples declare them, and what each computes."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import kiln
from kiln.config import open_model_dir
from kiln.demo import build_demo_repository
from kiln.tensor import DataType


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("demo")
    build_demo_repository(root)
    return root


def _run(repo: Path, name: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(str(repo / name / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    outputs: list[np.ndarray] = session.run(None, feeds)
    return outputs


def test_simple_int8_adds_and_subtracts_with_wraparound(repo: Path) -> None:
    spec = open_model_dir(repo / "simple_int8").spec
    assert (spec.platform, spec.max_batch_size) == ("onnxruntime_onnx", 8)
    # One thread: a tiny model, left out of the thread budget the server shares among simple's and mlp's instances.
    assert spec.parameters.get("intra_op_thread_count") == "1"
    assert [(t.name, t.datatype, t.dims) for t in (*spec.inputs, *spec.outputs)] == [
        (name, DataType.INT8, (16,)) for name in ("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1")]
    a = np.array([[127, -128, 5, 0] * 4, list(range(16))], dtype=np.int8)
    b = np.ones((2, 16), dtype=np.int8)
    total, difference = _run(repo, "simple_int8", {"INPUT0": a, "INPUT1": b})
    assert total.dtype == difference.dtype == np.int8
    np.testing.assert_array_equal(total, (a.astype(np.int16) + 1).astype(np.int8))  # 127 + 1 wraps to -128
    np.testing.assert_array_equal(difference, (a.astype(np.int16) - 1).astype(np.int8))


def _controls(spec_dir: Path) -> dict[str, str]:
    config = open_model_dir(spec_dir).spec.config
    kinds = config.sequence_batching.control_input[0].control[0].DESCRIPTOR.fields_by_name["kind"].enum_type
    return {c.name: kinds.values_by_number[c.control[0].kind].name for c in config.sequence_batching.control_input}


def test_simple_sequence_config_is_tritons(repo: Path) -> None:
    spec = open_model_dir(repo / "simple_sequence").spec
    assert spec.max_batch_size == 8
    assert [(t.name, t.datatype, t.dims) for t in spec.inputs] == [("INPUT", DataType.INT32, (1,))]
    assert [(t.name, t.datatype, t.dims) for t in spec.outputs] == [("OUTPUT", DataType.INT32, (1,))]
    assert _controls(repo / "simple_sequence") == {"START": "CONTROL_SEQUENCE_START",
                                                   "READY": "CONTROL_SEQUENCE_READY"}
    assert spec.config.sequence_batching.WhichOneof("strategy_choice") in (None, "direct")


def test_simple_dyna_sequence_config_is_tritons(repo: Path) -> None:
    spec = open_model_dir(repo / "simple_dyna_sequence").spec
    assert [t.name for t in spec.inputs] == ["INPUT"] and [t.name for t in spec.outputs] == ["OUTPUT"]
    assert _controls(repo / "simple_dyna_sequence") == {
        "START": "CONTROL_SEQUENCE_START", "END": "CONTROL_SEQUENCE_END", "READY": "CONTROL_SEQUENCE_READY",
        "CORRID": "CONTROL_SEQUENCE_CORRID"}
    batching = spec.config.sequence_batching
    assert batching.WhichOneof("strategy_choice") == "oldest"
    assert (batching.oldest.max_candidate_sequences, batching.oldest.max_queue_delay_microseconds) == (1024, 10000)
    assert batching.max_sequence_idle_microseconds == 10_000_000
    assert [g.count for g in spec.config.instance_group] == [2]
    assert spec.parameters.get("intra_op_thread_count") == "1"


def _column(*values: int, dtype: type = np.int32) -> np.ndarray:
    return np.array(values, dtype=dtype).reshape(-1, 1)


def test_simple_sequence_returns_input_plus_start_on_ready_rows(repo: Path) -> None:
    # Rows: a sequence's first request, a later one, a padding row (READY 0).
    (out,) = _run(repo, "simple_sequence", {"INPUT": _column(20, -7, 99), "START": _column(1, 0, 0),
                                            "READY": _column(1, 1, 0)})
    assert out.dtype == np.int32 and out.reshape(-1).tolist() == [21, -7, 0]


def test_simple_dyna_sequence_adds_the_correlation_id_on_the_last_request(repo: Path) -> None:
    feeds = {"INPUT": _column(0, 11, 1, 5), "START": _column(1, 0, 0, 0), "END": _column(0, 0, 1, 1),
             "READY": _column(1, 1, 1, 0), "CORRID": _column(1000, 1000, 1001, 2**32 + 3, dtype=np.uint64)}
    (out,) = _run(repo, "simple_dyna_sequence", feeds)
    assert out.dtype == np.int32 and out.reshape(-1).tolist() == [1, 11, 1002, 0]


def test_simple_identity_returns_any_bytes_unchanged(repo: Path) -> None:
    folder = repo / "simple_identity"
    packaged = resources.files("kiln.demo").joinpath("simple_identity_model.py").read_bytes()
    assert (folder / "1" / "model.py").read_bytes() == packaged
    spec = open_model_dir(folder).spec
    assert (spec.backend, spec.max_batch_size) == ("python", 8)
    assert [(t.name, t.datatype, t.dims) for t in (*spec.inputs, *spec.outputs)] == [
        ("INPUT0", DataType.BYTES, (-1,)), ("OUTPUT0", DataType.BYTES, (-1,))]
    data = np.array([[b"he\x00llo", b"\xff\xfe", b""], [b"\x00\x01\x02\x03", b"x", "ü".encode()]], dtype=object)
    with kiln.load(folder) as engine:
        out = engine.infer({"INPUT0": data})
    assert out["OUTPUT0"].shape == (2, 3) and out["OUTPUT0"].tolist() == data.tolist()
