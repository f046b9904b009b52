"""Compare results shaped like the reference experiment (anchors.md section 1): T4, ResNet-50, concurrency 1/8/16."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# Throughput (images/s) from the reference table; p99 values are illustrative, ordered direct < served < others.
THROUGHPUT = {"direct": (320, 2800, 3500), "served": (310, 2600, 3200), "served_with_others": (290, 2200, 2700)}
P99_MS = {"direct": (3.6, 4.0, 6.0), "served": (3.9, 4.6, 7.2), "served_with_others": (4.4, 5.5, 8.8)}
CONCURRENCY = (1, 8, 16)


def bench_row(concurrency: int, throughput: float, p99_ms: float, stable: bool = True) -> dict[str, Any]:
    """A `kiln bench` result row, with the fields advise does not read as well."""
    return {"concurrency": concurrency, "request_rate": None, "throughput_infer_per_s": throughput,
            "throughput_items_per_s": throughput,
            "latency_ms": {"avg": p99_ms * 0.8, "p50": p99_ms * 0.75, "p90": p99_ms * 0.9, "p95": p99_ms * 0.95,
                           "p99": p99_ms},
            "client_ms": None, "server_us": None, "stable": stable, "windows": 3, "errors": 0,
            "memory_mb": {"rss_idle": None, "rss_peak": None, "gpu_idle": None, "gpu_peak": None}}


def scenario(name: str, batching: bool = True, models: int = 1, scale: float = 1.0) -> dict[str, Any]:
    measured = zip(CONCURRENCY, THROUGHPUT[name], P99_MS[name], strict=True)
    rows = [bench_row(c, tp * scale, p99) for c, tp, p99 in measured]
    return {"name": name, "batching": batching, "models_loaded": models, "results": rows}


def reference_compare() -> dict[str, Any]:
    return {
        "model": "resnet50", "machine": {"gpu": "T4", "cpu_count": 8},
        "concurrency": list(CONCURRENCY),
        "scenarios": [scenario("direct", batching=False), scenario("served"),
                      scenario("served_with_others", models=3)],
        "memory_mb": {"direct": {"idle": 1200.0, "peak": 2800.0}, "served": {"idle": 1900.0, "peak": 3100.0},
                      "served_with_others": {"idle": 2500.0, "peak": 4100.0, "models": 3}},
    }


@pytest.fixture
def compare() -> dict[str, Any]:
    """A fresh reference-shaped compare result to edit."""
    return reference_compare()


@pytest.fixture
def write_compare(tmp_path: Path) -> Callable[[object], Path]:
    def write(data: object) -> Path:
        path = tmp_path / "compare.json"
        path.write_text(json.dumps(data))
        return path
    return write


@pytest.fixture
def make_scenario() -> Callable[..., dict[str, Any]]:
    return scenario


@pytest.fixture
def make_row() -> Callable[..., dict[str, Any]]:
    return bench_row
