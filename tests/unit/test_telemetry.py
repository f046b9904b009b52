"""Importing kiln turns ONNX Runtime's usage telemetry off unless the user chose otherwise (docs/security.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "import kiln, os, onnxruntime; print(os.environ.get('ORT_DISABLE_TELEMETRY'))"


def _probe(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "ORT_DISABLE_TELEMETRY"}
    if env_value is not None:
        env["ORT_DISABLE_TELEMETRY"] = env_value
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60,
                          check=True)
    return done.stdout.strip()


@pytest.mark.parametrize(("given", "seen"), [(None, "1"), ("0", "0"), ("1", "1")])
def test_importing_kiln_disables_onnxruntime_telemetry_unless_set(given: str | None, seen: str) -> None:
    assert _probe(given) == seen
