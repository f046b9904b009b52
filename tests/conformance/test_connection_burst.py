"""A burst of new connections to a running `kiln serve`, and a port that is already taken."""

from __future__ import annotations

import concurrent.futures
import shutil
import socket
import ssl
import subprocess
from pathlib import Path

import pytest

from kiln.demo import build_demo_repository
from kiln.testing.serve import KilnProcess, kiln_serve

pytestmark = pytest.mark.conformance

BURST = 300
READY_REQUEST = b"GET /v2/health/ready HTTP/1.1\r\nHost: kiln\r\n\r\n"


def _status(sock: socket.socket) -> bytes:
    head = b""
    while b"\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            break
        head += chunk
    return head.split(b"\r\n", 1)[0]


def test_every_connection_of_a_burst_is_served(kiln_server: KilnProcess) -> None:
    host, port = kiln_server.http_url.rsplit(":", 1)
    # All connections are open before the first request, as when a load balancer fills its pool.
    connections = [socket.create_connection((host, int(port)), timeout=30) for _ in range(BURST)]
    try:
        for sock in connections:
            sock.sendall(READY_REQUEST)
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(_status, connections))
    finally:
        for sock in connections:
            sock.close()
    assert statuses == [b"HTTP/1.1 200 OK"] * BURST


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_taken_http_port_stops_the_server_with_a_clear_log(tmp_path: Path, workers: str) -> None:
    repo = tmp_path / "repo"
    build_demo_repository(repo)
    taken = socket.create_server(("127.0.0.1", 0))
    log = tmp_path / "serve.log"
    try:
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="exited with status 1"):
            with kiln_serve([repo], "--http-port", str(port), "--http-workers", workers, log_path=log,
                            ready_timeout_s=20.0):
                pass
    finally:
        taken.close()
    text = log.read_text()
    assert f":{port}" in text and "in use" in text, text
    assert ("cannot listen on" if workers == "1" else "cannot serve HTTP on") in text, text


@pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl command line makes the test certificate")
def test_a_tls_burst_and_a_failed_handshake_are_handled(tmp_path: Path) -> None:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", "key.pem", "-out", "cert.pem", "-days", "1", "-subj", "/CN=localhost"],
                   cwd=tmp_path, check=True, capture_output=True)
    repo = tmp_path / "repo"
    build_demo_repository(repo)
    context = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
    context.check_hostname = False
    log = tmp_path / "serve.log"
    with kiln_serve([repo], "--https-certfile", str(tmp_path / "cert.pem"), "--https-keyfile",
                    str(tmp_path / "key.pem"), log_path=log, ready_timeout_s=30.0, context=context) as server:
        host, port = server.http_url.rsplit(":", 1)
        not_tls = socket.create_connection((host, int(port)), timeout=10)
        not_tls.sendall(READY_REQUEST)  # plain HTTP to a TLS port: the handshake fails, the server carries on
        connections = [socket.create_connection((host, int(port)), timeout=30) for _ in range(100)]

        def ready(sock: socket.socket) -> bytes:
            with context.wrap_socket(sock, server_hostname="localhost") as tls:
                tls.sendall(READY_REQUEST)
                return _status(tls)

        try:
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                statuses = list(pool.map(ready, connections))
        finally:
            not_tls.close()
            for sock in connections:
                sock.close()
    assert statuses == [b"HTTP/1.1 200 OK"] * 100
    assert "Traceback" not in log.read_text()
