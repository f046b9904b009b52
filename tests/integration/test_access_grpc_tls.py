"""gRPC over TLS (--grpc-use-ssl) and mutual TLS (--grpc-use-ssl-mutual) on a real `kiln serve`, in one process
and with --grpc-workers 2, called with tritonclient.grpc's ssl=True. Certificates (a CA, a server certificate for
127.0.0.1, a client certificate from the CA and one from another CA) are made with the openssl command line."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from kiln.testing.pki import make_pki
from kiln.testing.repo import make_repo, onnx_add_sub_model
from kiln.testing.serve import KilnProcess, kiln_serve

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="the openssl command line is needed to make test certificates")

@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_repo(tmp_path_factory.mktemp("repo"), add_sub=onnx_add_sub_model())


def _serve(repo: Path, pki: Path, *args: str) -> Iterator[KilnProcess]:
    with kiln_serve([repo], "--grpc-server-cert", str(pki / "server.pem"), "--grpc-server-key",
                    str(pki / "server.key"), "--http-workers", "1", *args) as process:
        yield process


@pytest.fixture(scope="module", params=["one process", "workers"])
def mutual(request: pytest.FixtureRequest, repo: Path, pki: Path) -> Iterator[KilnProcess]:
    workers = ("--grpc-workers", "2") if request.param == "workers" else ()
    yield from _serve(repo, pki, "--grpc-use-ssl-mutual", "true", "--grpc-root-cert", str(pki / "ca.pem"), *workers)


def _client(url: str, pki: Path, client: str | None = None, *, ssl: bool = True) -> grpcclient.InferenceServerClient:
    if not ssl:
        return grpcclient.InferenceServerClient(url)
    keys = {"private_key": str(pki / f"{client}.key"), "certificate_chain": str(pki / f"{client}.pem")} \
        if client else {}
    return grpcclient.InferenceServerClient(url, ssl=True, root_certificates=str(pki / "ca.pem"), **keys)


def _infer(client: grpcclient.InferenceServerClient) -> np.ndarray:
    inputs = [grpcclient.InferInput(f"INPUT{i}", [1, 4], "FP32") for i in range(2)]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.full((1, 4), 3.0, np.float32))
    output = client.infer("add_sub", inputs, client_timeout=30).as_numpy("OUTPUT0")
    assert output is not None
    return output


def _fails(client: grpcclient.InferenceServerClient) -> str:
    with pytest.raises(InferenceServerException) as caught:
        client.is_server_live(client_timeout=10)
    client.close()
    return str(caught.value.status())


def test_tls_answers_a_client_that_trusts_the_ca_and_refuses_plain_grpc(repo: Path, pki: Path) -> None:
    for served in _serve(repo, pki, "--grpc-use-ssl", "true"):
        client = _client(served.grpc_url, pki)
        assert client.is_server_live()
        np.testing.assert_array_equal(_infer(client), np.full((1, 4), 6.0, np.float32))
        client.close()
        assert _fails(_client(served.grpc_url, pki, ssl=False)) == "StatusCode.UNAVAILABLE"


def test_mutual_tls_answers_a_client_certificate_from_the_root(mutual: KilnProcess, pki: Path) -> None:
    client = _client(mutual.grpc_url, pki, "client")
    np.testing.assert_array_equal(_infer(client), np.full((1, 4), 6.0, np.float32))
    client.close()


@pytest.mark.parametrize("certificate", [None, "stranger"])
def test_mutual_tls_refuses_clients_without_an_accepted_certificate(mutual: KilnProcess, pki: Path,
                                                                    certificate: str | None) -> None:
    assert _fails(_client(mutual.grpc_url, pki, certificate)) == "StatusCode.UNAVAILABLE"


def test_a_bad_certificate_stops_kiln_serve_naming_it(repo: Path, pki: Path, tmp_path: Path) -> None:
    (tmp_path / "garbage.pem").write_text("not a certificate\n")
    command = [sys.executable, "-m", "kiln.cli", "serve", "--model-repository", str(repo), "--grpc-use-ssl", "true",
               "--grpc-server-cert", str(tmp_path / "garbage.pem"), "--grpc-server-key", str(pki / "server.key")]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert finished.returncode != 0
    assert "garbage.pem" in finished.stderr and "expected a PEM certificate chain" in finished.stderr, finished.stderr
