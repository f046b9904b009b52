"""`kiln serve` as an operator meets it: the startup log, a clean exit on SIGTERM / SIGINT, and a start that fails."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import httpx
import pytest

from kiln import serve_process
from kiln.demo import build_demo_repository
from kiln.serve_process import ServeFailed
from kiln.testing.serve import free_port, kiln_serve

pytestmark = pytest.mark.conformance


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_startup_log_and_clean_exit(tmp_path: Path, sig: signal.Signals) -> None:
    repo = tmp_path / "repo"
    build_demo_repository(repo)
    (repo / "broken").mkdir()
    (repo / "broken" / "config.pbtxt").write_text("max_batch_size: [")
    (repo / "broken" / "1").mkdir()
    log = tmp_path / "serve.log"
    with kiln_serve([repo], "--strict-readiness", "false", "--exit-on-error", "false",
                    "--gil-switch-interval-us", "500", log_path=log) as server:
        assert httpx.get(f"http://{server.http_url}/v2/health/live").status_code == 200
        server.process.send_signal(sig)
        assert server.process.wait(timeout=20) == 0
    text = log.read_text()
    for fragment in ("simple", "mlp", "READY", "broken", "UNAVAILABLE", "syntax error at line 1",
                     f"http://{server.http_url}", f"grpc://{server.grpc_url}", "ready in",
                     "GIL switch interval: 500 us"):
        assert fragment in text, text


def test_strict_readiness_reports_not_ready_with_a_broken_model(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    build_demo_repository(repo)
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "config.pbtxt").write_text('backend: "no_such_backend"')
    with pytest.raises(TimeoutError):
        with kiln_serve([repo], "--exit-on-error", "false", ready_timeout_s=3.0):
            pass


def test_exit_on_error_stops_a_server_with_a_broken_model(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    build_demo_repository(repo)
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "config.pbtxt").write_text('backend: "no_such_backend"')
    log = tmp_path / "serve.log"
    with pytest.raises(RuntimeError, match="exited with status 1"):
        with kiln_serve([repo], log_path=log):
            pass
    assert "failed to load" in log.read_text() and "no_such_backend" in log.read_text()


def test_a_server_that_exits_early_names_its_cause_without_a_log_path(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "config.pbtxt").write_text('backend: "no_such_backend"')
    with pytest.raises(ServeFailed, match="no_such_backend") as failed:
        with kiln_serve([repo]):
            pass
    assert not failed.value.port_taken


def test_a_port_taken_before_the_server_binds_it_gets_fresh_ports(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    repo = tmp_path / "repo"
    build_demo_repository(repo)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        picks = iter([port])
        monkeypatch.setattr(serve_process, "free_port", lambda: next(picks, None) or free_port())
        log = tmp_path / "serve.log"
        with kiln_serve([repo], log_path=log) as server:
            assert httpx.get(f"http://{server.http_url}/v2/health/ready").status_code == 200
            assert not server.http_url.endswith(f":{port}")
