"""mTLS on the edge-to-cloud link: a real `kiln serve` whose HTTP frontend requires client certificates, and an
EdgeRunner (cloud-fallback) that forwards every request to it.

A throwaway CA, a server certificate for 127.0.0.1/localhost and client certificates (one from the CA, one from
another CA) are made with the openssl command line for each test module."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from kiln.cli import edge as cli_edge
from kiln.cli import make_parser
from kiln.demo.models import build_mlp
from kiln.demo.repository import render_config
from kiln.edge import EdgeRunner, Policy
from kiln.edge.capture import ACKED, CaptureQueue, CaptureUploader
from kiln.edge.options import EdgeOptions
from kiln.edge.runner import CLOUD, LOCAL_CLOUD_ERROR, LOCAL_CLOUD_UNREACHABLE
from kiln.edge.serve import tls_context
from kiln.edge.sync import HttpSyncSource
from kiln.edge.tls import client_context, cloud_endpoint, split_url
from kiln.engines.base import Array
from kiln.errors import ConfigError
from kiln.testing.pki import make_pki
from kiln.testing.repo import write_model
from kiln.testing.serve import free_port, stop, wait_ready

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="the openssl command line is needed to make test certificates")

@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca.pem; server.pem/key (127.0.0.1, localhost); client.pem/key from ca; stranger.pem/key from another CA."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cloud")
    model = build_mlp()
    write_model(root, "mlp", model, render_config("mlp", model, 32).decode())
    return root


@pytest.fixture(scope="module")
def cloud(pki: Path, repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The https URL of a kiln serve that requires a client certificate from ca.pem."""
    port = free_port()
    command = [sys.executable, "-m", "kiln.cli", "serve", "--model-repository", str(repo), "--http-port", str(port),
               "--grpc-port", str(free_port()), "--metrics-port", str(free_port()),
               "--capture-dir", str(tmp_path_factory.mktemp("capture")), "--allow-model-download",
               "--https-certfile", str(pki / "server.pem"), "--https-keyfile", str(pki / "server.key"),
               "--https-client-ca", str(pki / "ca.pem")]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"https://127.0.0.1:{port}"
    try:
        wait_ready(f"127.0.0.1:{port}", process,
                   context=client_context(pki / "ca.pem", pki / "client.pem", pki / "client.key"))
        yield url
    finally:
        stop(process)


def always(inputs: Mapping[str, Array], outputs: Mapping[str, Array]) -> str:
    return "always forwarded"


def _row() -> dict[str, Array]:
    return {"INPUT0": np.random.default_rng(3).standard_normal((1, 64)).astype(np.float32)}


def _forward(repo: Path, url: str, context: ssl.SSLContext | None) -> tuple[str, str]:
    """(source, cloud error) of one request the edge forwards to ``url``."""
    with EdgeRunner(repo / "mlp", url, Policy(hook=always), cloud_timeout_s=3.0) as runner:
        assert runner.cloud is not None
        if context is not None:
            runner.cloud.use_tls(context)
        result = runner.infer(_row())
        assert result.outputs["OUTPUT0"].shape == (1, 10)
        return result.source, result.cloud_error


def test_the_cloud_answers_an_edge_with_a_client_certificate(pki: Path, repo: Path, cloud: str) -> None:
    context = client_context(pki / "ca.pem", pki / "client.pem", pki / "client.key")
    assert _forward(repo, cloud, context) == (CLOUD, "")
    assert HttpSyncSource(cloud, tls=context).ready_versions("mlp") == [1]


def test_capture_uploads_over_mtls(pki: Path, cloud: str, tmp_path: Path) -> None:
    queue = CaptureQueue(tmp_path / "queue")
    sample = queue.put("1", _row(), None, None, ["always forwarded"], CLOUD)
    context = client_context(pki / "ca.pem", pki / "client.pem", pki / "client.key")
    assert CaptureUploader(queue, cloud, "mlp", tls=context).upload(sample) == ACKED
    assert queue.pending() == []


@pytest.mark.parametrize("client", [None, "stranger"])
def test_without_an_accepted_client_certificate_the_edge_answers_locally(pki: Path, repo: Path, cloud: str,
                                                                        client: str | None) -> None:
    cert, key = (pki / f"{client}.pem", pki / f"{client}.key") if client else (None, None)
    source, error = _forward(repo, cloud, client_context(pki / "ca.pem", cert, key))
    assert source in (LOCAL_CLOUD_UNREACHABLE, LOCAL_CLOUD_ERROR)
    assert "ended the TLS session" in error and "client certificate" in error, error


def test_an_edge_that_does_not_trust_the_server_answers_locally(pki: Path, repo: Path, cloud: str) -> None:
    context = client_context(pki / "other-ca.pem", pki / "client.pem", pki / "client.key")
    source, error = _forward(repo, cloud, context)
    assert source == LOCAL_CLOUD_UNREACHABLE
    assert "CERTIFICATE_VERIFY_FAILED" in error, error


def test_kiln_edge_process_forwards_over_mtls(pki: Path, repo: Path, cloud: str, tmp_path: Path) -> None:
    port = free_port()
    command = [sys.executable, "-m", "kiln.cli", "edge", str(repo / "mlp"), "--cloud-url", cloud, "--max-prob-below",
               "1.1", "--cloud-ca", str(pki / "ca.pem"), "--cloud-cert", str(pki / "client.pem"),
               "--cloud-key", str(pki / "client.key"), "--port", str(port)]
    with open(tmp_path / "edge.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"127.0.0.1:{port}", process, 30.0)
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        x = _row()["INPUT0"]
        tensor = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=True)
        assert client.infer("mlp", [tensor]).get_response()["parameters"]["kiln_source"] == CLOUD
        client.close()
    finally:
        process.terminate()
        process.wait(timeout=15)


def test_tritonclient_speaks_mtls_to_kiln_serve(pki: Path, cloud: str) -> None:
    options = {"ca_certs": str(pki / "ca.pem"), "certfile": str(pki / "client.pem"), "keyfile": str(pki / "client.key")}
    client = httpclient.InferenceServerClient(cloud.removeprefix("https://"), ssl=True, ssl_options=options)
    assert client.is_model_ready("mlp")
    client.close()


def _edge_args(*argv: str) -> EdgeOptions:
    """The options `kiln edge model.onnx ARGV` runs with."""
    return cli_edge.edge_options(make_parser().parse_args(["edge", "model.onnx", *argv]))


def test_tls_flags_need_an_https_url(pki: Path) -> None:
    with pytest.raises(ConfigError, match="need an https:// --cloud-url"):
        tls_context(_edge_args("--cloud-url", "http://127.0.0.1:1", "--cloud-ca", str(pki / "ca.pem")))
    with pytest.raises(ConfigError, match="plain http, but TLS settings"):
        HttpSyncSource("127.0.0.1:1", tls=client_context(pki / "ca.pem"))
    with pytest.raises(ConfigError, match="needs its client certificate"):
        client_context(key=pki / "client.key")
    assert tls_context(_edge_args("--cloud-url", "https://127.0.0.1:1")) is None
    assert split_url("https://cloud.example") == ("https", "cloud.example", 443)
    assert cloud_endpoint("https://cloud.example:9443").context is not None  # the system's CAs
    with pytest.raises(ConfigError, match="cloud url 'ftp://cloud:21'"):
        split_url("ftp://cloud:21")
    assert tls_context(_edge_args("--cloud-url", "https://127.0.0.1:1", "--cloud-ca", str(pki / "ca.pem"))) \
        is not None


def test_serve_refuses_incomplete_https_flags(pki: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kiln.cli import main

    assert main(["serve", "--https-client-ca", str(pki / "ca.pem")]) == 1
    assert "need --https-certfile" in capsys.readouterr().err
    assert main(["serve", "--https-certfile", str(pki / "absent.pem")]) == 1
    assert "--https-certfile" in capsys.readouterr().err
