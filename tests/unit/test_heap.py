"""kiln serve's processes keep freed heap memory for the next request instead of faulting it in again (kiln/heap.py),
measured as minor page faults in a fresh interpreter, and leave malloc alone where the user tuned it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kiln.heap import user_tuned_malloc

# A worker's request in miniature: a body of an image's size arrives, its tensor bytes are copied once, both go.
_ROUNDS = """
import resource, sys
from kiln.heap import keep_freed_heap
kept = keep_freed_heap() if sys.argv[1] == "keep" else None
body = bytes(301_145)
def request():
    received = bytes(bytearray(body))
    return len(received[89:])
for _ in range(50):
    request()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(500):
    request()
print(kept, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 500)
"""


def _faults_per_request(mode: str, **environment: str) -> tuple[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", _ROUNDS, mode], env={**env, **environment}, capture_output=True,
                          text=True, timeout=60, check=True)
    kept, faults = done.stdout.split()
    return kept, float(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_a_request_sized_body_no_longer_faults_its_pages_in_every_time() -> None:
    _, untouched = _faults_per_request("default")
    if untouched < 50:
        pytest.skip(f"this C library keeps freed memory by itself ({untouched:.0f} faults per request)")
    kept, faults = _faults_per_request("keep")
    assert kept == "True"
    assert faults < 5, f"{faults:.0f} minor faults per request with the thresholds set, {untouched:.0f} without"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_malloc_settings_of_the_users_own_are_left_alone() -> None:
    kept, _ = _faults_per_request("keep", MALLOC_TRIM_THRESHOLD_="131072")
    assert kept == "False"


def test_user_settings_are_recognised_in_either_form() -> None:
    assert not user_tuned_malloc({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})
    assert user_tuned_malloc({"GLIBC_TUNABLES": "glibc.pthread.rseq=0:glibc.malloc.trim_threshold=1"})
    assert user_tuned_malloc({"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert not user_tuned_malloc({})
