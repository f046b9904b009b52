"""The edge and the cloud as two real processes on loopback: a `kiln serve` with the demo mlp (logits [N, 10]) as
the cloud, and an EdgeRunner (in-process, or `python -m kiln.edge` driven by the real tritonclient.http).

The threshold is the median of the model's own max softmax probabilities over the test inputs, so half the rows
are confident and half are not, and every test asserts that both kinds occur."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

import kiln
from kiln.demo.models import build_mlp
from kiln.demo.repository import render_config
from kiln.edge import EdgeRunner, Policy
from kiln.edge.cloud import CloudClient
from kiln.engines.base import Array, Engine
from kiln.errors import UnavailableError
from kiln.testing.repo import write_model
from kiln.testing.serve import KilnProcess, free_port, kiln_serve, wait_ready


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cloud")
    model = build_mlp()
    write_model(root, "mlp", model, render_config("mlp", model, 32).decode())
    return root


@pytest.fixture(scope="module")
def cloud(repo: Path) -> Iterator[KilnProcess]:
    with kiln_serve([repo]) as process:
        yield process


@pytest.fixture(scope="module")
def rows(repo: Path) -> tuple[float, Array, Array]:
    """(threshold, confident rows, uncertain rows) from the model's actual outputs."""
    x = np.random.default_rng(7).standard_normal((32, 64)).astype(np.float32)
    logits = kiln.load(repo / "mlp").infer({"INPUT0": x})["OUTPUT0"].astype(np.float64)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    top = (probs / probs.sum(axis=1, keepdims=True)).max(axis=1)
    threshold = float(np.median(top))
    confident, uncertain = x[top > threshold], x[top < threshold]
    assert len(confident) >= 8 and len(uncertain) >= 8
    return threshold, confident, uncertain


def cloud_successes(cloud: KilnProcess) -> int:
    with urllib.request.urlopen(f"http://{cloud.http_url}/v2/models/mlp/stats", timeout=5) as response:
        stats = json.loads(response.read())
    return int(stats["model_stats"][0]["inference_stats"]["success"]["count"])


def one(x: Array, i: int) -> dict[str, Array]:
    return {"INPUT0": x[i:i + 1]}


def test_cloud_fallback_answers_uncertain_requests_from_the_cloud(repo: Path, cloud: KilnProcess,
                                                                  rows: tuple[float, Array, Array]) -> None:
    threshold, confident, uncertain = rows
    before = cloud_successes(cloud)
    with EdgeRunner(repo / "mlp", cloud.http_url, Policy(max_prob_below=threshold)) as runner:
        local = [runner.infer(one(confident, i)) for i in range(4)]
        forwarded = [runner.infer(one(uncertain, i)) for i in range(4)]
        assert {r.source for r in local} == {"local"} and all(r.reasons == [] for r in local)
        assert {r.source for r in forwarded} == {"cloud"}
        for result in forwarded:
            assert result.reasons == [f"max probability of OUTPUT0 below {threshold} (row 0)"]
            assert result.cloud_outputs is not None and result.local_outputs is not None
            assert result.outputs["OUTPUT0"] is result.cloud_outputs["OUTPUT0"]
            np.testing.assert_allclose(result.outputs["OUTPUT0"], result.local_outputs["OUTPUT0"], rtol=1e-4,
                                       atol=1e-5)
        assert runner.stats.snapshot()["cloud_answers"] == 4
    assert cloud_successes(cloud) - before == 4


def test_a_batch_with_one_uncertain_row_is_forwarded_whole(repo: Path, cloud: KilnProcess,
                                                           rows: tuple[float, Array, Array]) -> None:
    threshold, confident, uncertain = rows
    batch = np.concatenate([confident[:3], uncertain[:1]])
    with EdgeRunner(repo / "mlp", cloud.http_url, Policy(max_prob_below=threshold)) as runner:
        result = runner.infer({"INPUT0": batch})
    assert result.source == "cloud" and result.reasons[0].endswith("(row 3)")
    assert result.outputs["OUTPUT0"].shape == (4, 10)


def test_shadow_answers_locally_and_the_copies_reach_the_cloud(repo: Path, cloud: KilnProcess,
                                                               rows: tuple[float, Array, Array]) -> None:
    threshold, confident, uncertain = rows
    before = cloud_successes(cloud)
    runner = EdgeRunner(repo / "mlp", cloud.http_url, Policy(mode="shadow", max_prob_below=threshold))
    results = [runner.infer(one(confident, i)) for i in range(3)] + [runner.infer(one(uncertain, i))
                                                                       for i in range(5)]
    runner.close()  # waits for the queued copies
    assert {r.source for r in results} == {"local"}
    assert [r.flagged for r in results] == [False] * 3 + [True] * 5
    assert all(r.cloud_outputs is None for r in results)
    assert runner.stats.snapshot()["shadow_sent"] == 5
    assert cloud_successes(cloud) - before == 5


def test_a_stopped_cloud_leaves_local_answers_with_the_reason(repo: Path, rows: tuple[float, Array, Array]) -> None:
    threshold, confident, uncertain = rows
    with kiln_serve([repo]) as cloud:
        runner = EdgeRunner(repo / "mlp", cloud.http_url, Policy(max_prob_below=threshold), cloud_timeout_s=2.0)
        assert runner.infer(one(uncertain, 0)).source == "cloud"
    with runner:
        down = runner.infer(one(uncertain, 1))
        assert down.source == "local (cloud unreachable)"
        assert down.reasons == [f"max probability of OUTPUT0 below {threshold} (row 0)"]
        assert "ConnectionRefusedError" in down.cloud_error
        np.testing.assert_array_equal(down.outputs["OUTPUT0"], down.local_outputs["OUTPUT0"])  # type: ignore[index]
        assert runner.infer(one(confident, 0)).source == "local"
        assert runner.stats.snapshot()["cloud_unreachable"] == 1


def test_a_cloud_error_falls_back_to_the_local_answer(repo: Path, cloud: KilnProcess,
                                                      rows: tuple[float, Array, Array]) -> None:
    threshold, _, uncertain = rows
    policy = Policy(max_prob_below=threshold)
    with EdgeRunner(repo / "mlp", cloud.http_url, policy, cloud_model="no_such_model") as runner:
        result = runner.infer(one(uncertain, 0))
    assert result.source == "local (cloud error)"
    assert "answered 404" in result.cloud_error and "no_such_model" in result.cloud_error


class FailsOnNaN(Engine):
    thread_safe = True

    def __init__(self, inner: Engine) -> None:
        super().__init__(inner.spec)
        self.inner = inner

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        if any(np.isnan(array).any() for array in inputs.values()):
            raise RuntimeError("NaN in the input")
        return self.inner.execute(inputs, outputs)


def test_a_local_engine_failure_is_answered_by_the_cloud(repo: Path, cloud: KilnProcess,
                                                         rows: tuple[float, Array, Array]) -> None:
    _, confident, _ = rows
    bad = confident[:2].copy()
    bad[0, 5] = np.nan
    engine = FailsOnNaN(kiln.load(repo / "mlp"))
    with EdgeRunner(engine, cloud.http_url, Policy(mode="shadow")) as runner:
        result = runner.infer({"INPUT0": bad})
    assert result.source == "cloud" and result.local_outputs is None
    assert result.reasons == ["local engine failed: RuntimeError: NaN in the input"]
    assert result.outputs["OUTPUT0"].shape == (2, 10)


def test_a_local_failure_with_the_cloud_down_fails_as_unavailable(repo: Path,
                                                                   rows: tuple[float, Array, Array]) -> None:
    bad = rows[1][:1].copy()
    bad[0, 0] = np.nan
    with EdgeRunner(FailsOnNaN(kiln.load(repo / "mlp")), f"127.0.0.1:{free_port()}", Policy()) as runner:
        with pytest.raises(UnavailableError, match="local engine failed: RuntimeError: NaN in the input; and the "
                                                   "cloud gave no answer: .*ConnectionRefusedError"):
            runner.infer({"INPUT0": bad})
        assert runner.stats.snapshot()["cloud_unreachable"] == 1


@pytest.fixture()
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield int(sock.getsockname()[1])


def test_a_silent_cloud_times_out(silent_port: int) -> None:
    result = CloudClient(f"127.0.0.1:{silent_port}", "mlp", timeout_s=0.3).infer(
        {"INPUT0": np.zeros((1, 64), np.float32)})
    assert result.status == "unreachable" and "timed out" in result.error


def test_shadow_copies_beyond_the_queue_are_dropped_and_counted(repo: Path, silent_port: int,
                                                                rows: tuple[float, Array, Array]) -> None:
    threshold, _, uncertain = rows
    policy = Policy(mode="shadow", max_prob_below=threshold)
    runner = EdgeRunner(repo / "mlp", f"127.0.0.1:{silent_port}", policy, cloud_timeout_s=0.5, shadow_workers=1,
                        shadow_queue=1)
    results = [runner.infer(one(uncertain, i)) for i in range(3)]  # the first copy holds the only slot
    runner.close()
    assert {r.source for r in results} == {"local"}
    stats = runner.stats.snapshot()
    assert (stats["shadow_dropped"], stats["shadow_failed"], stats["shadow_sent"]) == (2, 1, 0)


def test_kiln_edge_process_serves_v2_infer_to_tritonclient(repo: Path, cloud: KilnProcess, tmp_path: Path,
                                                           rows: tuple[float, Array, Array]) -> None:
    threshold, confident, uncertain = rows
    port = free_port()
    command = [sys.executable, "-m", "kiln.cli", "edge", str(repo / "mlp"), "--cloud-url", cloud.http_url,
               "--max-prob-below", str(threshold), "--port", str(port)]
    with open(tmp_path / "edge.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"127.0.0.1:{port}", process, 30.0)
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        assert client.is_model_ready("mlp") and client.get_model_metadata("mlp")["versions"] == ["1"]
        sources = []
        for x in (confident[:1], uncertain[:1]):
            tensor = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x, binary_data=True)
            result = client.infer("mlp", [tensor])
            parameters = result.get_response()["parameters"]
            sources.append((parameters["kiln_source"], bool(parameters["kiln_forward_reasons"])))
            np.testing.assert_allclose(result.as_numpy("OUTPUT0"), kiln.load(repo / "mlp").infer(
                {"INPUT0": x})["OUTPUT0"], rtol=1e-4, atol=1e-5)
        assert sources == [("local", False), ("cloud", True)]
        with pytest.raises(Exception, match="not served by this edge"):
            client.infer("other", [tensor])
        client.close()
    finally:
        process.terminate()
        process.wait(timeout=15)
