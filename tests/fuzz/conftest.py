"""The fuzz surfaces' servers: the HTTP app in this process, and one `kiln serve` for the wire and gRPC shares.

The generators, the oracle and the drivers live beside the long run (benchmarks/_fuzz_*.py); these tests run them
briefly under hypothesis with a fixed seed (derandomized, no example database), so a failure reproduces.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from _fuzz_drivers import Grpc, InProcessHttp, WireHttp, fuzz_server  # noqa: E402
from _fuzz_oracle import Finding  # noqa: E402

settings.register_profile("kiln-fuzz", derandomize=True, database=None, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
FUZZ = settings.get_profile("kiln-fuzz")


# The shared-memory object's name is one per test process (runs beside each other must not truncate each other's
# object under a mapping), of a fixed length so that the generated inputs' bytes do not depend on the process.
_PROCESS = f"{os.getpid() % 10**7:07d}"

KNOWN_HIT: Counter[str] = Counter()
"""How often each KNOWN_FINDINGS class let an input through in this session (shown in the terminal summary)."""


def unexpected(findings: list[Finding]) -> list[str]:
    """The findings outside KNOWN_FINDINGS, as lines for the assertion message."""
    KNOWN_HIT.update(f.known for f in findings if f.known is not None)
    return [f"{f.kind} on {f.surface}: {f.detail}" for f in findings if f.known is None]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if KNOWN_HIT:
        classes = ", ".join(f"{name} x{count}" for name, count in sorted(KNOWN_HIT.items()))
        terminalreporter.write_line(f"fuzz: known findings let through (KNOWN_FINDINGS): {classes}")


@pytest.fixture(scope="module")
def in_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessHttp]:
    driver = InProcessHttp(tmp_path_factory.mktemp("fuzz-app"), f"app{_PROCESS}")
    yield driver
    driver.close()


@pytest.fixture(scope="session")
def wire(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WireHttp, Grpc]]:
    workdir = tmp_path_factory.mktemp("fuzz-wire")
    tag = f"wire{_PROCESS}"
    with fuzz_server(workdir, tag) as server:
        http, grpc = WireHttp(server, workdir / "repo", tag), Grpc(server, tag)
        yield http, grpc
        http.close()
        grpc.close()
