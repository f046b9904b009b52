"""--http-workers: its default follows the host's usable CPUs; the flag takes a count and refuses a negative one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kiln.service_options import ServiceOptions, default_grpc_workers, default_http_workers


@pytest.mark.parametrize(("cpus", "workers"), [(1, 1), (2, 1), (7, 1), (8, 2), (12, 3), (16, 4), (64, 4)])
def test_the_default_follows_the_usable_cpus(monkeypatch: pytest.MonkeyPatch, cpus: int, workers: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    assert default_http_workers() == workers


def test_the_api_default_is_one_process() -> None:
    assert ServiceOptions().http_workers == 1


def test_a_negative_count_is_a_usage_error() -> None:
    serve = subprocess.run([sys.executable, "-m", "kiln.cli", "serve", "--http-workers", "-1"], capture_output=True,
                           text=True, timeout=60)
    assert serve.returncode == 2 and "argument --http-workers: expected 0 or more, got -1" in serve.stderr


@pytest.mark.parametrize(("cpus", "workers"), [(2, 0), (7, 0), (8, 2), (16, 4), (64, 4)])
def test_the_grpc_default_follows_the_http_one_where_that_runs_workers(monkeypatch: pytest.MonkeyPatch, cpus: int,
                                                                       workers: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    assert default_grpc_workers() == workers
    assert ServiceOptions().grpc_workers == 0  # the API's default stays gRPC in the server process
