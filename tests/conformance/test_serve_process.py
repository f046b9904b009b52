"""`kiln serve` as an operator meets it: the startup log, and a clean exit on SIGTERM / SIGINT."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from kiln.demo import build_demo_repository
from kiln.testing.serve import kiln_serve

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
