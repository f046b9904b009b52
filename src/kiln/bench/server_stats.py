"""The server-side time breakdown: cumulative statistics-extension counters, read before and after a measurement,
turned into per-request averages (what perf_analyzer prints as queue / compute input / infer / output)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

PHASES = ("queue", "compute_input", "compute_infer", "compute_output")


@dataclass(frozen=True)
class Duration:
    count: int = 0
    ns: int = 0


@dataclass(frozen=True)
class ServerCounters:
    """A model's cumulative statistics (every version summed): successful requests and, per phase, how many
    requests it covered and their total nanoseconds."""

    success: int = 0
    phases: Mapping[str, Duration] = field(default_factory=dict)

    def __sub__(self, earlier: ServerCounters) -> ServerCounters:
        phases = {name: Duration(self.phase(name).count - earlier.phase(name).count,
                                 self.phase(name).ns - earlier.phase(name).ns) for name in PHASES}
        return ServerCounters(self.success - earlier.success, phases)

    def phase(self, name: str) -> Duration:
        return self.phases.get(name, Duration())

    def per_request_us(self) -> dict[str, float]:
        """Each phase's average per request in microseconds (0 where no request was counted)."""
        return {name: (d.ns / d.count / 1000.0 if d.count > 0 else 0.0)
                for name, d in ((n, self.phase(n)) for n in PHASES)}


def add_counters(parts: Iterable[ServerCounters]) -> ServerCounters:
    """Sum several versions' counters into the model's."""
    success = 0
    totals = {name: [0, 0] for name in PHASES}
    for part in parts:
        success += part.success
        for name in PHASES:
            totals[name][0] += part.phase(name).count
            totals[name][1] += part.phase(name).ns
    return ServerCounters(success, {name: Duration(c, ns) for name, (c, ns) in totals.items()})


def counters_from_doc(doc: Mapping[str, Any], model: str) -> ServerCounters:
    """Counters from a statistics-extension document (``{"model_stats": [...]}``, HTTP JSON or the gRPC message
    rendered as a dict with the same field names). Only entries for ``model`` count."""
    parts: list[ServerCounters] = []
    for entry in doc.get("model_stats", []):
        if entry.get("name") != model:
            continue
        stats = entry.get("inference_stats", {})
        phases = {name: _duration(stats.get(name)) for name in PHASES}
        parts.append(ServerCounters(_duration(stats.get("success")).count, phases))
    return add_counters(parts)


def _duration(value: object) -> Duration:
    # gRPC's JSON rendering writes uint64 values as strings; int() takes both.
    if not isinstance(value, Mapping):
        return Duration()
    return Duration(int(value.get("count", 0)), int(value.get("ns", 0)))
