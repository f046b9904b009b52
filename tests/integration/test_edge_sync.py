"""Model sync across two processes on loopback: a `kiln serve` cloud (poll mode, model download on, an API key)
and an edge in this process. A version published on the cloud reaches the edge; a corrupt one is rejected.

Corruption is made the way it happens in practice on a server that already loaded a version: the model file in
the cloud's repository is damaged after the load (the server keeps serving the engine it has, so the version stays
READY and listed); the edge downloads bytes that do not load, rejects the version and keeps the one it runs.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.cli import edge as cli_edge
from kiln.cli import make_parser
from kiln.demo.models import build_mlp
from kiln.demo.repository import render_config
from kiln.edge import EdgeRunner, Policy
from kiln.edge.options import EdgeOptions
from kiln.edge.serve import start_sync
from kiln.edge.sync import HttpSyncSource, ModelSync, SyncOptions
from kiln.errors import KilnError
from kiln.testing.repo import write_model
from kiln.testing.serve import kiln_serve

KEY = "edge-secret"
INTERVAL_S = 0.5


def publish(repo: Path, version: int, seed: int) -> Path:
    """Write a version into a hidden folder, then rename it in, so the cloud never sees half a file."""
    model = build_mlp(seed)
    staging = repo / "mlp" / f".publish-{version}"
    staging.mkdir(parents=True)
    (staging / "model.onnx").write_bytes(model.SerializeToString())
    staging.rename(repo / "mlp" / str(version))
    return repo / "mlp"


class Traffic:
    """Requests sent back to back to the edge from a thread, counting any that fail."""

    def __init__(self, edge: EdgeRunner, inputs: dict[str, np.ndarray]) -> None:
        self.edge, self.inputs = edge, inputs
        self.answered = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.edge.infer(self.inputs)
                self.answered += 1
            except Exception as exc:
                self.failures.append(repr(exc))
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def wait_for(condition: Callable[[], bool], timeout_s: float) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


def test_published_version_reaches_the_edge_and_a_corrupt_one_is_rejected(tmp_path: Path) -> None:
    cloud_repo = tmp_path / "cloud"
    model = build_mlp(0)
    write_model(cloud_repo, "mlp", model, render_config("mlp", model, 8).decode())
    edge_dir = tmp_path / "edge" / "mlp"
    shutil.copytree(cloud_repo / "mlp", edge_dir)
    x = {"INPUT0": np.random.default_rng(0).standard_normal((2, 64), dtype=np.float32)}
    with kiln_serve([cloud_repo], "--allow-model-download", "--api-key", KEY, "--model-control-mode", "poll",
                    "--repository-poll-secs", "0.5", "--allow-grpc", "false", "--allow-metrics", "false",
                    log_path=tmp_path / "cloud.log") as cloud, \
            EdgeRunner(edge_dir, cloud.http_url, Policy(mode="local-only")) as edge:
        with pytest.raises(KilnError, match="401"):  # the download endpoints want the key
            HttpSyncSource(cloud.http_url).list_files("mlp", 1)
        source = HttpSyncSource(cloud.http_url, api_key=KEY)
        options = edge_options(str(edge_dir), "--cloud-url", cloud.http_url, "--sync-interval-s", str(INTERVAL_S),
                               "--cloud-api-key", KEY, "--probation-requests", "1")
        sync = start_sync(options, edge)  # what `kiln edge` runs
        assert sync is not None
        load = Traffic(edge, x)
        try:
            publish(cloud_repo, 2, seed=1)
            wait_for(lambda: 2 in source.ready_versions("mlp"), 15)
            took = wait_for(lambda: edge.version == "2", 10)
            assert took <= INTERVAL_S + 2.0  # one poll interval, plus download, load and smoke inference
            v2 = kiln.load(cloud_repo / "mlp", 2).infer(x)["OUTPUT0"]
            v1 = kiln.load(cloud_repo / "mlp", 1).infer(x)["OUTPUT0"]
            answer = edge.infer(x).outputs["OUTPUT0"]
            np.testing.assert_allclose(answer, v2, rtol=1e-6)
            assert not np.allclose(answer, v1)
        finally:
            load.stop()
            sync.close()
        assert load.answered > 0 and load.failures == []  # the swap dropped no request
        # v3 is published and loaded by the cloud while the edge is not watching; then its file is damaged.
        publish(cloud_repo, 3, seed=2)
        wait_for(lambda: 3 in source.ready_versions("mlp"), 15)
        model_file = cloud_repo / "mlp" / "3" / "model.onnx"
        model_file.write_bytes(model_file.read_bytes()[:1000])
        time.sleep(1.0)  # the cloud's poll sees the change, fails to reload, keeps serving its v3
        assert 3 in source.ready_versions("mlp")
        sync = ModelSync(edge, source, edge_dir, options=SyncOptions(interval_s=INTERVAL_S))
        sync.start()
        try:
            wait_for(lambda: 3 in sync.rejected, 10)
        finally:
            sync.close()
        assert edge.version == "2"
        assert not (edge_dir / "3").exists()
        np.testing.assert_allclose(edge.infer(x).outputs["OUTPUT0"], v2, rtol=1e-6)


def edge_options(*argv: str) -> EdgeOptions:
    """The options `kiln edge ARGV` runs with."""
    return cli_edge.edge_options(make_parser().parse_args(["edge", *argv]))
