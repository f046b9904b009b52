"""Capture end to end: an EdgeRunner with capture on, and a real `kiln serve --capture-dir` as the cloud that goes
away and comes back on the same port. Every forwarded request must arrive in the cloud's store exactly once;
confident requests are not captured."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.capture import export_samples
from kiln.demo.models import build_mlp
from kiln.demo.repository import render_config
from kiln.edge import EdgeRunner, Policy
from kiln.edge.capture import EdgeCapture
from kiln.engines.base import Array
from kiln.testing.repo import write_model
from kiln.testing.serve import free_port, kiln_serve, wait_ready

KEY = "capture-test-key"


@contextmanager
def cloud(repo: Path, capture_dir: Path, port: int) -> Iterator[str]:
    """`kiln serve` on ``port`` (HTTP only) storing captured samples in ``capture_dir``."""
    command = [sys.executable, "-m", "kiln.cli", "serve", "--model-repository", str(repo), "--http-port", str(port),
               "--allow-grpc", "false", "--allow-metrics", "false", "--capture-dir", str(capture_dir),
               "--api-key", KEY]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"127.0.0.1:{port}", process)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=15)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cloud")
    model = build_mlp()
    write_model(root, "mlp", model, render_config("mlp", model, 32).decode())
    return root


def split_rows(repo: Path) -> tuple[float, Array, Array]:
    """(threshold, confident rows, uncertain rows) from the model's own max softmax probabilities."""
    x = np.random.default_rng(11).standard_normal((24, 64)).astype(np.float32)
    logits = kiln.load(repo / "mlp").infer({"INPUT0": x})["OUTPUT0"].astype(np.float64)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    top = (probs / probs.sum(axis=1, keepdims=True)).max(axis=1)
    threshold = float(np.median(top))
    return threshold, x[top > threshold], x[top < threshold]


def wait_empty(capture: EdgeCapture, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while capture.queue.pending() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert capture.queue.pending() == []


def test_the_cloud_going_away_and_coming_back_loses_no_captured_sample(repo: Path, tmp_path: Path) -> None:
    threshold, confident, uncertain = split_rows(repo)
    assert len(confident) >= 4 and len(uncertain) >= 6
    port, capture_dir = free_port(), tmp_path / "captures"
    runner = EdgeRunner(repo / "mlp", f"127.0.0.1:{port}", Policy(max_prob_below=threshold), cloud_timeout_s=2.0)
    capture = EdgeCapture(runner, tmp_path / "edge", api_key=KEY, edge_id="edge-7", min_backoff_s=0.05,
                          max_backoff_s=0.2).start()
    sent: list[Array] = []
    try:
        with cloud(repo, capture_dir, port):
            for i in range(4):
                assert runner.infer({"INPUT0": confident[i:i + 1]}).source == "local"
            for i in range(3):
                assert runner.infer({"INPUT0": uncertain[i:i + 1]}).source == "cloud"
                sent.append(uncertain[i:i + 1])
            wait_empty(capture)
        # The cloud is down: the edge answers locally and keeps the samples on disk.
        for i in range(3, 6):
            assert runner.infer({"INPUT0": uncertain[i:i + 1]}).source == "local (cloud unreachable)"
            sent.append(uncertain[i:i + 1])
        time.sleep(0.3)  # the uploader tries, fails and backs off meanwhile
        assert len(capture.queue.pending()) == 3
        with cloud(repo, capture_dir, port):
            wait_empty(capture)
    finally:
        capture.close()
        runner.close()
    stats = capture.queue.stats.snapshot()
    assert (stats["queued"], stats["uploaded"], stats["dropped"], stats["rejected"]) == (6, 6, 0, 0)

    index = export_samples(capture_dir, "mlp", None, tmp_path / "export.npz")
    assert len(index) == 6 and len({s["id"] for s in index}) == 6
    assert [s["source"] for s in index] == ["cloud"] * 3 + ["local (cloud unreachable)"] * 3
    assert all(s["edge"] == "edge-7" and s["reason"].startswith("max probability of OUTPUT0") for s in index)
    with np.load(tmp_path / "export.npz") as exported:
        np.testing.assert_array_equal(exported["input/INPUT0"], np.concatenate(sent))
        assert exported["local/OUTPUT0"].shape == (6, 10)
        assert exported["cloud/OUTPUT0"].shape == (3, 10)  # the cloud answered only while it was up


def post_status(url: str, model: str = "mlp", key: str | None = None) -> tuple[int, bytes]:
    headers = {"Kiln-Capture-Id": "a", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"http://{url}/v2/kiln/models/{model}/versions/1/capture", data=b"x",
                                     headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


def test_the_capture_endpoint_is_off_without_capture_dir(repo: Path) -> None:
    with kiln_serve([repo]) as process:
        status, body = post_status(process.http_url)
        assert status == 403 and b"--capture-dir" in body


def test_the_capture_endpoint_needs_the_api_key_and_a_served_model(repo: Path, tmp_path: Path) -> None:
    with cloud(repo, tmp_path / "captures", free_port()) as url:
        assert post_status(url)[0] == 401
        assert post_status(url, "nope", KEY)[0] == 404
        status, body = post_status(url, key=KEY)
        assert status == 400 and b"not a readable npz" in body
