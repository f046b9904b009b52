"""benchmarks/cluster.py end to end at the smallest settings, as a user runs it (its own process, where Ray starts a
local cluster): one replica, a second of load each, one latency level; the JSON holds a measured rate and both
paths' latencies. Slow: Ray starts and deploys twice (about a minute on 2 cores)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ._smoke import BENCHMARKS, SRC, read_json

pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
pytest.importorskip("tritonclient.http")


def _script(name: str, *argv: str, timeout: float = 300) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p),
           "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *argv], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_cluster_script_measures_replicas_and_the_ray_path(tmp_path: Path) -> None:
    output = tmp_path / "cluster.json"
    _script("cluster", "--replicas", "1", "--duration", "1", "--latency-duration", "1", "--warmup", "0.3",
            "--latency-concurrency", "1", "--client-processes", "1", "--replica-cpus", "0.5", "--output", str(output))
    data = read_json(output)
    (scaled,) = data["scaling"]
    assert scaled["replicas"] == 1 and scaled["requests"] > 0 and scaled["failed"] == 0
    (latency,) = data["overhead"]
    assert latency["concurrency"] == 1
    assert latency["ray"]["requests"] > 0 and latency["kiln_serve"]["requests"] > 0
    assert latency["ray"]["p50_ms"] > 0 and latency["kiln_serve"]["p50_ms"] > 0
    verdicts = data["bars"]  # no 4-replica run: only the overhead bar
    assert len(verdicts) == 1 and "Ray p50 overhead at c=1" in verdicts[0]
    assert output.with_suffix(".txt").read_text().count("| 1 |") == 2  # a row in each table
