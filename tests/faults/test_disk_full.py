"""A full disk while storing a captured sample or staging a synced version: the one operation fails clearly, what it
wrote is removed, and the server or edge keeps serving what it served.

ENOSPC comes from the operating system itself: a file kiln writes to is made a symlink to /dev/full, whose every
write fails with ENOSPC (no root, mount or injected writer needed). For capture that file is the version's
index.jsonl (the sample's npz goes to a temporary file whose name kiln draws at random); for the edge sync it is
the file the download writes into. Where unprivileged user namespaces are allowed, a capture store on a small
tmpfs (``unshare -rm``, mounted for the server alone) fills up for real while the npz itself is written.
"""

from __future__ import annotations

import errno
import http.client
import io
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.demo.models import build_mlp
from kiln.demo.repository import render_config
from kiln.edge import EdgeRunner, Policy
from kiln.edge.sync import REJECTED_FILE, HttpSyncSource, ModelSync, SyncOptions
from kiln.server.capture import INDEX
from kiln.testing.repo import write_model
from kiln.testing.serve import free_port, kiln_serve, stop, wait_ready

from ._models import write_identity_model

DEV_FULL = Path("/dev/full")
pytestmark = pytest.mark.skipif(not DEV_FULL.exists(), reason="needs /dev/full")


def capture(address: str, sample_id: str, rows: int = 1) -> tuple[int, dict[str, object]]:
    body = io.BytesIO()
    np.savez(body, **{"input/X": np.ones((rows, 1), np.int64)})
    connection = http.client.HTTPConnection(address, timeout=10)
    connection.request("POST", "/v2/kiln/models/steady/versions/1/capture", body.getvalue(),
                       {"Kiln-Capture-Id": sample_id, "Content-Type": "application/octet-stream"})
    answer = connection.getresponse()
    status, doc = answer.status, json.loads(answer.read())
    connection.close()
    return status, doc


def infer_steady(address: str) -> int:
    body = {"inputs": [{"name": "X", "datatype": "INT64", "shape": [1, 1], "data": [5]}]}
    connection = http.client.HTTPConnection(address, timeout=10)
    connection.request("POST", "/v2/models/steady/infer", json.dumps(body), {"Content-Type": "application/json"})
    answer = connection.getresponse()
    doc = json.loads(answer.read())
    connection.close()
    assert answer.status == 200, doc
    return int(doc["outputs"][0]["data"][0])


def test_capture_on_a_full_disk_fails_the_sample_and_leaves_the_store_as_it_was(tmp_path: Path) -> None:
    repo, store = tmp_path / "repo", tmp_path / "capture"
    write_identity_model(repo)
    with kiln_serve([repo], "--capture-dir", str(store), log_path=tmp_path / "kiln.log") as server:
        assert capture(server.http_url, "a") == (200, {"id": "a", "stored": True})
        folder = store / "steady" / "1"
        index = folder / INDEX
        kept = index.read_bytes()
        index.unlink()
        index.symlink_to(DEV_FULL)  # the disk is full from here on

        status, doc = capture(server.http_url, "b")
        assert status == 503, doc
        message = str(doc["error"])
        assert "model 'steady'" in message and "'b'" in message and "out of space" in message, message
        assert sorted(p.name for p in folder.iterdir()) == ["0.npz", INDEX]  # no 1.npz, no temporary file
        assert infer_steady(server.http_url) == 5

        index.unlink()  # space again: the same sample goes through
        index.write_bytes(kept)
        assert capture(server.http_url, "b") == (200, {"id": "b", "stored": True})
        lines = [json.loads(line) for line in index.read_text().splitlines()]
        assert [(e["id"], e["file"]) for e in lines] == [("a", "0.npz"), ("b", "1.npz")]


def user_namespaces() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not user_namespaces(), reason="needs unshare -rm (unprivileged user and mount namespaces)")
def test_capture_store_on_a_filled_tmpfs(tmp_path: Path) -> None:
    repo, store = tmp_path / "repo", tmp_path / "capture"
    write_identity_model(repo)
    store.mkdir()
    port = free_port()
    serve = [sys.executable, "-m", "kiln.cli", "serve", "--model-repository", str(repo), "--capture-dir", str(store),
             "--http-port", str(port), "--grpc-port", str(free_port()), "--metrics-port", str(free_port())]
    script = f"mount -t tmpfs -o size=256k tmpfs {shlex.quote(str(store))} && exec {shlex.join(serve)}"
    with open(tmp_path / "kiln.log", "wb") as log:
        process = subprocess.Popen(["unshare", "-rm", "sh", "-c", script], stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        wait_ready(address, process)
        folder = Path(f"/proc/{process.pid}/root") / str(store).lstrip("/") / "steady" / "1"  # the server's view
        stored = 0
        while (answer := capture(address, f"s{stored}", rows=8000))[0] == 200:  # about 64 kB a sample
            stored += 1
            assert stored < 10, "the 256 kB tmpfs never filled up"
        status, doc = answer
        assert status == 503 and "out of space" in str(doc["error"]), doc
        assert stored >= 1
        assert sorted(p.name for p in folder.iterdir()) == sorted([INDEX, *(f"{i}.npz" for i in range(stored))])
        lines = [json.loads(line) for line in (folder / INDEX).read_text().splitlines()]
        assert [e["id"] for e in lines] == [f"s{i}" for i in range(stored)]
        assert infer_steady(address) == 5
        assert capture(address, "small") == (200, {"id": "small", "stored": True})  # a sample that still fits
    finally:
        stop(process)


class FullDiskSource(HttpSyncSource):
    """The cloud as it is; the first ``full_files`` files it downloads land on a full disk."""

    def __init__(self, url: str, full_files: int) -> None:
        super().__init__(url)
        self.full_files = full_files
        self.staging_seen: list[Path] = []

    def download(self, model: str, version: int, path: str, destination: Path) -> None:
        self.staging_seen.append(destination)
        if self.full_files > 0:
            self.full_files -= 1
            destination.symlink_to(DEV_FULL)
        super().download(model, version, path, destination)


def test_sync_on_a_full_disk_keeps_the_served_version_and_retries(tmp_path: Path) -> None:
    cloud_repo = tmp_path / "cloud"
    write_model(cloud_repo, "mlp", build_mlp(0), render_config("mlp", build_mlp(0), 8).decode())
    edge_dir = tmp_path / "edge" / "mlp"
    shutil.copytree(cloud_repo / "mlp", edge_dir)
    (cloud_repo / "mlp" / "2").mkdir()
    (cloud_repo / "mlp" / "2" / "model.onnx").write_bytes(build_mlp(1).SerializeToString())
    x = {"INPUT0": np.random.default_rng(0).standard_normal((1, 64), dtype=np.float32)}
    v1 = kiln.load(cloud_repo / "mlp", 1).infer(x)["OUTPUT0"]
    v2 = kiln.load(cloud_repo / "mlp", 2).infer(x)["OUTPUT0"]
    with kiln_serve([cloud_repo], "--allow-model-download", "--allow-grpc", "false", "--allow-metrics", "false",
                    log_path=tmp_path / "cloud.log") as cloud, \
            EdgeRunner(edge_dir, cloud.http_url, Policy(mode="local-only")) as edge:
        source = FullDiskSource(cloud.http_url, full_files=1)
        sync = ModelSync(edge, source, edge_dir, options=SyncOptions(probation_requests=1))
        try:
            assert sync.step() is None  # the download met ENOSPC
            assert source.staging_seen and not any(p.parent.exists() for p in source.staging_seen)
            assert sorted(p.name for p in edge_dir.iterdir()) == ["1", "config.pbtxt"]  # nothing staged is left
            assert 2 not in sync.rejected and not (edge_dir / REJECTED_FILE).exists()  # not the version's fault
            assert edge.version == "1"
            np.testing.assert_allclose(edge.infer(x).outputs["OUTPUT0"], v1, rtol=1e-6)

            assert sync.step() == 2  # the disk has room again: the next poll takes the version
            assert edge.version == "2"
            np.testing.assert_allclose(edge.infer(x).outputs["OUTPUT0"], v2, rtol=1e-6)
        finally:
            sync.close()


def test_dev_full_gives_enospc() -> None:
    """The premise of this module: writing to /dev/full fails with ENOSPC."""
    with pytest.raises(OSError) as caught, DEV_FULL.open("wb") as f:
        f.write(b"x")
        f.flush()
    assert caught.value.errno == errno.ENOSPC
