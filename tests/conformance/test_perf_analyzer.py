"""NVIDIA's perf_analyzer (Triton's C++ client library) against `kiln serve`: HTTP and gRPC, tensors in the request
body and in system shared memory, on `simple` and `mlp`. Each run must complete with a throughput line and no
request error.

perf_analyzer is not a Python package dependency: the test runs where the binary is found, as
``$KILN_PERF_ANALYZER`` or ``perf_analyzer`` on PATH (the perf-analyzer wheel ships it; it needs glibc >= 2.38),
and is skipped elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from kiln.demo import build_demo_repository
from kiln.testing.serve import KilnProcess, kiln_serve

pytestmark = pytest.mark.conformance

RUN_TIMEOUT_S = 120  # one run takes a few seconds; a hang (as over gRPC with shared memory once) runs into this


def _binary() -> str | None:
    return os.environ.get("KILN_PERF_ANALYZER") or shutil.which("perf_analyzer")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    if _binary() is None:
        pytest.skip("perf_analyzer not found: set KILN_PERF_ANALYZER or put it on PATH (pip install perf-analyzer, "
                    "glibc >= 2.38)")
    repo = tmp_path_factory.mktemp("repo")
    build_demo_repository(repo)
    with kiln_serve([repo], "--allow-client-shm", "true", "--exit-timeout-secs", "5") as process:
        yield process


CASES = [(model, protocol, memory, ()) for model in ("simple", "mlp") for protocol in ("http", "grpc")
         for memory in ("none", "system")]
CASES += [("simple", "grpc", "system", ("--streaming",)), ("simple", "grpc", "system", ("--async",))]
CASE_IDS = ["-".join([model, protocol, memory, *(flag.strip("-") for flag in extra)])
            for model, protocol, memory, extra in CASES]


@pytest.mark.parametrize(("model", "protocol", "memory", "extra"), CASES, ids=CASE_IDS)
def test_perf_analyzer_completes(server: KilnProcess, model: str, protocol: str, memory: str,
                                 extra: tuple[str, ...]) -> None:
    binary = _binary()
    assert binary is not None
    url = server.http_url if protocol == "http" else server.grpc_url
    command = [binary, "-m", model, "-u", url, "-i", protocol, "--shared-memory", memory,
               "--concurrency-range", "4", "--measurement-mode", "count_windows",
               "--measurement-request-count", "50", "--stability-percentage", "999", "--max-trials", "3", *extra]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"perf_analyzer did not finish within {RUN_TIMEOUT_S}s: {' '.join(command)}\n{exc.stdout!r}")
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "throughput:" in output, output
    assert "error" not in output.lower(), output  # e.g. "Thread [0] had error: ..."
