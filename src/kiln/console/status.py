"""The console's status document: one JSON snapshot of everything the live page shows, built from what the
server keeps already (statistics, repository index, configs, A/B routing) plus a window of recent latencies.

The page polls it; throughput is the difference of two snapshots' cumulative counts over their ``time_ms``
(the page computes it, so the server keeps no per-client state).
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.server.capture import CaptureStore, live_samples
from kiln.server.server import Server
from kiln.server.stats import ModelStats, RequestTimes

WINDOW_S = 60.0
MAX_SAMPLES = 2_000  # per model version: enough for a p99, small enough to sort at every poll
_KIND = {0: "AUTO", 1: "GPU", 2: "CPU", 3: "MODEL"}


class LatencyWindow:
    """Request and queue durations of the last ``WINDOW_S`` seconds per model version, for p50/p99. Attached to
    the server the first time the page asks for status, so a server nobody watches pays nothing per request."""

    def __init__(self, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._samples: dict[tuple[str, str], collections.deque[tuple[int, int, int]]] = {}

    def observe(self, times: RequestTimes) -> None:
        key = (times.model, times.version)
        with self._lock:
            window = self._samples.get(key)
            if window is None:
                window = self._samples[key] = collections.deque(maxlen=MAX_SAMPLES)
            window.append((self._clock(), times.request_ns, times.queue_ns))

    def percentiles(self, model: str, version: str) -> dict[str, float | int | None]:
        """p50/p99 of request time and p50 of queue time in ms over the window, and how many requests it holds."""
        since = self._clock() - int(WINDOW_S * 1e9)
        with self._lock:
            recent = [s for s in self._samples.get((model, version), ()) if s[0] >= since]
        requests = sorted(s[1] for s in recent)
        queues = sorted(s[2] for s in recent)
        return {"samples": len(recent), "p50_ms": _rank(requests, 0.5), "p99_ms": _rank(requests, 0.99),
                "queue_p50_ms": _rank(queues, 0.5)}


def _rank(ordered_ns: list[int], q: float) -> float | None:
    """Nearest-rank quantile in ms; None for an empty window."""
    if not ordered_ns:
        return None
    return ordered_ns[max(0, math.ceil(q * len(ordered_ns)) - 1)] / 1e6


class StatusSource:
    """Builds the status document of one server. ``gpus``: a reader of GPU figures (None: no NVML);
    ``captures``: the capture store (None: capture is off); ``report``: a `kiln bench compare` output folder."""

    def __init__(self, server: Server, *, gpus: Callable[[], list[dict[str, Any]]] | None = None,
                 captures: CaptureStore | None = None, report: Path | None = None) -> None:
        self.server = server
        self.latency: LatencyWindow | None = None
        self._gpus = gpus
        self._captures = captures
        self._report = report
        self._attach_lock = threading.Lock()

    def document(self) -> dict[str, Any]:
        self._attach()
        assert self.latency is not None
        server = self.server
        index = server.repository_index()
        stats = {(s.name, s.version): s for s in server.model_statistics()}
        models: dict[str, dict[str, Any]] = {}
        for entry in index:
            model = models.setdefault(entry.name, {"name": entry.name, "versions": [], "routing": None})
            if entry.version:
                model["versions"].append(self._version(entry.name, entry.version, entry.state, entry.reason,
                                                       stats.get((entry.name, entry.version))))
            else:
                model["state"], model["reason"] = entry.state, entry.reason
        for model in models.values():
            model["routing"] = self._routing(model["name"]) if len(model["versions"]) > 1 else None
        return {"time_ms": time.time_ns() // 1_000_000, "server": server.metadata(), "ready": server.ready(),
                "inflight": server.inflight, "models": list(models.values()),
                "gpus": self._gpus() if self._gpus is not None else None,
                "captures": self._capture_summary(), "report": self._report_summary()}

    def _attach(self) -> None:
        with self._attach_lock:
            if self.latency is None:
                self.latency = LatencyWindow()
                self.server.add_request_observer(self.latency.observe)

    def _version(self, name: str, version: str, state: str, reason: str, stats: ModelStats | None) -> dict[str, Any]:
        doc: dict[str, Any] = {"version": version, "state": state, "reason": reason,
                               "instances": self._instances(name, version) if state == "READY" else []}
        if stats is not None:
            doc["stats"] = _stats(stats)
            assert self.latency is not None
            doc["latency"] = self.latency.percentiles(name, version)
        return doc

    def _instances(self, name: str, version: str) -> list[dict[str, Any]]:
        try:
            config = self.server.model_config(name, version)
        except KilnError:  # unloaded between the index and here
            return []
        return [{"name": g.name, "kind": _KIND.get(g.kind, str(g.kind)), "count": g.count, "gpus": list(g.gpus)}
                for g in config.instance_group]

    def _routing(self, name: str) -> dict[str, Any] | None:
        try:
            return asdict(self.server.routing(name))
        except KilnError:
            return None

    def _capture_summary(self) -> list[dict[str, Any]] | None:
        if self._captures is None:
            return None
        return [_capture_folder(folder, self._captures.root) for folder in _capture_folders(self._captures.root)]

    def _report_summary(self) -> dict[str, Any] | None:
        if self._report is None:
            return None
        files = sorted(p.name for p in self._report.iterdir() if p.is_file()) if self._report.is_dir() else []
        return {"path": str(self._report), "files": files,
                "modified_ms": int(self._report.stat().st_mtime * 1000) if self._report.exists() else None}


def _stats(s: ModelStats) -> dict[str, Any]:
    """Cumulative figures; the page turns two of them into rates."""
    return {"inference_count": s.inference_count, "execution_count": s.execution_count,
            "success": s.success.count, "success_ns": s.success.ns, "fail": s.fail.count,
            "queue_ns": s.queue.ns, "failures_by_reason": dict(s.failures_by_reason),
            "batch_sizes": {str(size): b.compute_infer.count for size, b in sorted(s.batch_stats.items())},
            "last_inference_ms": s.last_inference_ms}


def _capture_folders(root: Path) -> Iterator[Path]:
    return (p for p in sorted(root.glob("*/*")) if p.is_dir())


def _capture_folder(folder: Path, root: Path) -> dict[str, Any]:
    samples = live_samples(folder)
    reasons = collections.Counter(str(s.get("reason", "")) for s in samples)
    edges = sorted({str(s.get("edge", "")) for s in samples if s.get("edge")})
    model, version = folder.relative_to(root).parts
    return {"model": model, "version": version, "samples": len(samples), "edges": edges,
            "reasons": dict(reasons), "last_time": max((s.get("time", 0) for s in samples), default=None),
            "bytes": sum(int(s.get("bytes", 0)) for s in samples)}

