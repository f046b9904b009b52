"""A model's record is read on the request path while the manager's thread adds and drops versions."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator

import pytest

from kiln.server.registry import ModelRecord, ModelState, VersionRecord


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Threads switch every microsecond, so a reader that is not atomic meets a writer within a second."""
    saved = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(saved)


def test_ready_versions_while_versions_come_and_go(fast_switching: None) -> None:
    record = ModelRecord("m", None, versions={v: VersionRecord(v, ModelState.READY) for v in range(1, 51)})
    stop = threading.Event()

    def churn() -> None:  # new versions arrive, old ones are dropped twenty at a time, as polls do
        version = 100
        while not stop.is_set():
            record.versions[version] = VersionRecord(version, ModelState.READY)
            version += 1
            if version % 20 == 0:
                for old in range(version - 20, version):
                    record.versions.pop(old, None)

    writer = threading.Thread(target=churn)
    writer.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            ready = record.ready_versions()  # raised "dictionary changed size during iteration" before
            assert ready[:50] == list(range(1, 51))
    finally:
        stop.set()
        writer.join()
