"""The capture store and `kiln capture export`: atomic files, idempotent ids, rotation, the index, the export."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from kiln.capture import export_samples
from kiln.cli import main
from kiln.errors import InvalidArgumentError, NotFoundError
from kiln.server.capture import INDEX, REPLICA_STORE_PREFIX, CaptureStore, Sample, live_samples, read_index


def npz(rows: int = 1, value: float = 0.0, cloud: bool = True) -> bytes:
    arrays = {"input/INPUT0": np.full((rows, 4), value, np.float32),
              "local/OUTPUT0": np.full((rows, 3), value + 1, np.float32)}
    if cloud:
        arrays["cloud/OUTPUT0"] = np.full((rows, 3), value + 2, np.float32)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def test_a_sample_is_written_with_its_index_line(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path, 1 << 20)
    payload = npz(2, 5.0)
    assert store.add("mlp", "1", Sample("a", "max probability below 0.5 (row 0)", "cloud", "edge-1"), payload)
    folder = tmp_path / "mlp" / "1"
    assert (folder / "0.npz").read_bytes() == payload
    assert {p.name for p in folder.iterdir()} == {INDEX, "0.npz"}
    [entry] = list(read_index(folder))
    assert entry["id"] == "a" and entry["file"] == "0.npz" and entry["bytes"] == len(payload)
    assert entry["reason"] == "max probability below 0.5 (row 0)" and entry["edge"] == "edge-1"
    assert entry["source"] == "cloud" and entry["time"] > 0


def test_a_repeated_id_is_acknowledged_and_not_stored_twice_also_after_a_restart(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path, 1 << 20)
    assert store.add("mlp", "1", Sample("a"), npz())
    assert not store.add("mlp", "1", Sample("a"), npz(value=9.0))
    restarted = CaptureStore(tmp_path, 1 << 20)
    assert not restarted.add("mlp", "1", Sample("a"), npz())
    assert restarted.add("mlp", "1", Sample("b"), npz())
    assert [e["file"] for e in live_samples(tmp_path / "mlp" / "1")] == ["0.npz", "1.npz"]


def test_past_the_bound_the_oldest_files_go_and_the_index_says_so(tmp_path: Path) -> None:
    size = len(npz())
    store = CaptureStore(tmp_path, 3 * size)
    for i in range(3):
        store.add("mlp", "1", Sample(f"s{i}"), npz(value=i))
    store.add("mlp", "2", Sample("s3"), npz(value=3))
    assert not (tmp_path / "mlp" / "1" / "0.npz").exists()
    assert store.total_bytes == 3 * size
    assert [e["id"] for e in live_samples(tmp_path / "mlp" / "1")] == ["s1", "s2"]
    assert {"deleted": "0.npz", "id": "s0"}.items() <= list(read_index(tmp_path / "mlp" / "1"))[-1].items()
    # The rotated id is still known: a late retry of it is not stored again.
    restarted = CaptureStore(tmp_path, 3 * size)
    assert restarted.total_bytes == 3 * size
    assert not restarted.add("mlp", "1", Sample("s0"), npz())
    restarted.add("mlp", "1", Sample("s4"), npz())
    assert [e["id"] for e in live_samples(tmp_path / "mlp" / "1")] == ["s2", "s4"]


def test_no_temporary_file_is_left_and_a_torn_index_line_is_skipped(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path, 1 << 20)
    store.add("mlp", "1", Sample("a"), npz())
    folder = tmp_path / "mlp" / "1"
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]
    with (folder / INDEX).open("a") as f:
        f.write('{"id": "torn", "fi')
    restarted = CaptureStore(tmp_path, 1 << 20)
    assert restarted.add("mlp", "1", Sample("b"), npz())
    assert [e["id"] for e in live_samples(folder)] == ["a", "b"]


@pytest.mark.parametrize(("model", "version", "sample_id", "payload", "expected"), [
    ("../x", "1", "a", npz(), "invalid model name '../x'"),
    ("mlp", "v1", "a", npz(), "version 'v1' is not a number"),
    ("mlp", "1", "a/b", npz(), "sample id 'a/b'"),
    ("mlp", "1", "a", b"not a zip", "not a readable npz"),
    ("mlp", "1", "a", npz()[:-20], "not a readable npz"),
])
def test_bad_samples_are_refused(tmp_path: Path, model: str, version: str, sample_id: str, payload: bytes,
                                 expected: str) -> None:
    with pytest.raises(InvalidArgumentError, match=expected.replace(".", r"\.").replace("(", r"\(")):
        CaptureStore(tmp_path, 1 << 20).add(model, version, Sample(sample_id), payload)


def test_arrays_must_be_named_by_kind(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, INPUT0=np.zeros((1, 4), np.float32))
    with pytest.raises(InvalidArgumentError, match="array names must be input/<name>"):
        CaptureStore(tmp_path, 1 << 20).add("mlp", "1", Sample("a"), buffer.getvalue())


def test_export_concatenates_the_samples_and_writes_the_index(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path / "captures", 1 << 20)
    store.add("mlp", "1", Sample("a", "r0", "cloud", "e"), npz(2, 0.0))
    store.add("mlp", "1", Sample("b", "r1", "local (cloud unreachable)", "e"), npz(1, 10.0, cloud=False))
    store.add("mlp", "2", Sample("c", "r2", "cloud", "e"), npz(3, 20.0))
    output = tmp_path / "out" / "mlp.npz"
    assert main(["capture", "export", "--capture-dir", str(tmp_path / "captures"), "--model", "mlp", "--output",
                 str(output)]) == 0
    with np.load(output) as exported:
        assert sorted(exported.files) == ["cloud/OUTPUT0", "input/INPUT0", "local/OUTPUT0"]
        assert exported["input/INPUT0"][:, 0].tolist() == [0, 0, 10, 20, 20, 20]
        assert exported["cloud/OUTPUT0"][:, 0].tolist() == [2, 2, 22, 22, 22]
    index = json.loads(output.with_suffix(".json").read_text())
    assert index["model"] == "mlp"
    assert [(s["id"], s["version"], s["reason"]) for s in index["samples"]] == [("a", "1", "r0"), ("b", "1", "r1"),
                                                                               ("c", "2", "r2")]
    assert index["samples"][1]["rows"] == {"input/INPUT0": [2, 3], "local/OUTPUT0": [2, 3]}
    assert index["samples"][2]["rows"]["cloud/OUTPUT0"] == [2, 5]
    only = export_samples(tmp_path / "captures", "mlp", "2", tmp_path / "v2.npz")
    assert [s["id"] for s in only] == ["c"]


def test_export_merges_the_stores_of_a_clusters_replicas_by_time_and_keeps_a_retried_id_once(tmp_path: Path) -> None:
    first = CaptureStore(tmp_path / f"{REPLICA_STORE_PREFIX}aaa", 1 << 20)
    second = CaptureStore(tmp_path / f"{REPLICA_STORE_PREFIX}bbb", 1 << 20)
    first.add("mlp", "1", Sample("a"), npz(1, 0.0))
    second.add("mlp", "1", Sample("b"), npz(1, 10.0))
    first.add("mlp", "1", Sample("c"), npz(1, 20.0))
    second.add("mlp", "1", Sample("a"), npz(1, 99.0))  # an edge's retry that reached the other replica
    second.add("mlp", "2", Sample("d"), npz(1, 30.0))
    index = export_samples(tmp_path, "mlp", None, tmp_path / "out.npz")
    assert [(s["id"], s["version"]) for s in index] == [("a", "1"), ("b", "1"), ("c", "1"), ("d", "2")]
    with np.load(tmp_path / "out.npz") as exported:
        assert exported["input/INPUT0"][:, 0].tolist() == [0, 10, 20, 30]
    assert [s["id"] for s in export_samples(tmp_path, "mlp", "2", tmp_path / "v2.npz")] == ["d"]
    with pytest.raises(NotFoundError, match="model 'mlp' version 3"):
        export_samples(tmp_path, "mlp", "3", tmp_path / "x.npz")


def test_export_of_an_unknown_model_or_version_is_not_found(tmp_path: Path) -> None:
    CaptureStore(tmp_path, 1 << 20).add("mlp", "1", Sample("a"), npz())
    with pytest.raises(NotFoundError, match="model 'other'"):
        export_samples(tmp_path, "other", None, tmp_path / "x.npz")
    with pytest.raises(NotFoundError, match="model 'mlp' version 7"):
        export_samples(tmp_path, "mlp", "7", tmp_path / "x.npz")


def test_export_refuses_arrays_that_do_not_concatenate(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path, 1 << 20)
    store.add("mlp", "1", Sample("a"), npz())
    buffer = io.BytesIO()
    np.savez(buffer, **{"input/INPUT0": np.zeros((1, 5), np.float32)})
    store.add("mlp", "2", Sample("b"), buffer.getvalue())
    with pytest.raises(InvalidArgumentError, match="unlike the earlier samples"):
        export_samples(tmp_path, "mlp", None, tmp_path / "x.npz")


def test_an_npz_compressed_with_a_method_zipfile_lacks_is_refused_as_bad_input(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, **{"input/x": np.arange(4, dtype=np.float32)})
    payload = bytearray(buffer.getvalue())
    # The compression method field (offset 8 of the local header, 10 of the central one) set to 99 (AES): zipfile
    # raises NotImplementedError reading it.
    payload[8:10] = (99).to_bytes(2, "little")
    central = payload.rfind(b"PK\x01\x02")
    payload[central + 10:central + 12] = (99).to_bytes(2, "little")
    with pytest.raises(InvalidArgumentError, match="not a readable npz"):
        CaptureStore(tmp_path, 1 << 20).add("simple", "1", Sample("a"), bytes(payload))
