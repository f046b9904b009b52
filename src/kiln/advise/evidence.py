"""What a ``kiln bench compare`` result says about the choice: p99 against the budget, the served/direct throughput
ratio, memory per extra model and what dynamic batching added.

``derive`` turns a :class:`CompareResult` into an :class:`Evidence`: the two measured points the rules read (direct
and the served deployment that matches the model count, at the expected concurrency) and the lines the answer
prints. Nothing here decides; the rules in ``rules.py`` do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kiln.advise.compare_file import CompareResult, Cpu, Row, Scenario
from kiln.advise.inputs import Inputs

# kiln bench's default stability band: throughput differences smaller than this are within measurement noise.
NOISE = 0.10
# Cores one thread or process used, on average over a level, from which it counts as the limit (what it did in the
# rest of the time was waiting its turn).
SATURATED = 0.85
# The machine's idle share (percent) under which its cores count as the limit.
BUSY_MACHINE_PCT = 10.0


@dataclass(frozen=True)
class Point:
    """One deployment measured at (or nearest above) the expected concurrency."""

    label: str
    concurrency: int
    p99_ms: float | None
    throughput_per_s: float | None
    cpu: Cpu | None = None  # of the process under test at that row, where kiln bench measured it
    batch_rows: float | None = None  # the server's rows per execution there (served rows)


@dataclass(frozen=True)
class Evidence:
    source: CompareResult
    direct: Point | None
    served: Point | None
    direct_peak_mb: float | None
    served_peak_mb: float | None
    per_extra_model_mb: float | None
    throughput_ratio: dict[str, dict[int, float]]  # served label -> concurrency -> served/direct
    batching_gain: dict[int, float]  # concurrency -> throughput with batching / without - 1
    lines: tuple[str, ...]
    missing: tuple[str, ...]

    def memory_totals_mb(self, models: int) -> tuple[float, float] | None:
        """(one direct process per model, one server hosting them all), extrapolated from the measurements."""
        direct, served, extra = self.direct_peak_mb, self.served_peak_mb, self.per_extra_model_mb
        if models < 2 or direct is None or served is None or extra is None:
            return None
        return models * direct, served + (models - 1) * extra


def derive(result: CompareResult, inputs: Inputs) -> Evidence:
    missing = list(result.missing)
    lines = [_measured_line(result)]
    labels = _labels(result.scenarios)
    lines += _latency_lines(result.scenarios, labels, inputs.latency_budget_ms)
    ratios, throughput_lines = _throughput(result.scenarios, labels)
    lines += throughput_lines
    per_extra, memory_lines = _memory(result, missing)
    lines += memory_lines
    gain, batching_lines = _batching(result, missing)
    lines += batching_lines
    lines += _together_lines(result.scenarios, labels)
    direct = _point(result.named("direct"), labels, inputs.concurrency)
    served_name = "served_with_others" if inputs.models > 1 and result.named("served_with_others") else "served"
    if not result.named(served_name):
        served_name = "served_with_others"
    served = _point(result.named(served_name), labels, inputs.concurrency)
    lines += _expected_lines(inputs.concurrency, (direct, served))
    lines += _limit_lines(served)
    unstable = [f"{labels[id(s)]} c={r.concurrency}" for s in result.scenarios for r in s.rows if r.stable is False]
    if unstable:
        lines.append(f"unstable measurements (outside the stability band): {', '.join(unstable)}")
    lines += [f"ignored: {item}" for item in result.ignored]
    direct_memory, served_memory = result.memory.get("direct"), result.memory.get("served")
    return Evidence(source=result, direct=direct, served=served,
                    direct_peak_mb=direct_memory.peak_mb if direct_memory else None,
                    served_peak_mb=served_memory.peak_mb if served_memory else None,
                    per_extra_model_mb=per_extra, throughput_ratio=ratios, batching_gain=gain, lines=tuple(lines),
                    missing=tuple(missing))


def _labels(scenarios: Sequence[Scenario]) -> dict[int, str]:
    """Display names; the batching setting is named only where a scenario was measured both ways."""
    labels: dict[int, str] = {}
    for scenario in scenarios:
        label = scenario.name.replace("_", " ")
        if scenario.name == "served_with_others" and scenario.models_loaded is not None:
            label = f"served with {scenario.models_loaded} models"
        if sum(s.name == scenario.name for s in scenarios) > 1:
            label += " (batching)" if scenario.batching else " (no batching)"
        labels[id(scenario)] = label
    return labels


def _measured_line(result: CompareResult) -> str:
    model = result.model or "an unnamed model"
    machine = f" on {result.machine}" if result.machine else ""
    return f"measured: {model}{machine} ({result.path})"


def _concurrencies(scenarios: Sequence[Scenario]) -> list[int]:
    return sorted({r.concurrency for s in scenarios for r in s.rows})


def _row(scenario: Scenario, concurrency: int) -> Row | None:
    return next((r for r in scenario.rows if r.concurrency == concurrency), None)


def _latency_lines(scenarios: Sequence[Scenario], labels: dict[int, str], budget_ms: float | None) -> list[str]:
    budget = "" if budget_ms is None else f" (budget {budget_ms:g} ms)"
    lines = [f"p99 latency by concurrency{budget}:"]
    for concurrency in _concurrencies(scenarios):
        parts = []
        for scenario in scenarios:
            row = _row(scenario, concurrency)
            if row is None or row.p99_ms is None:
                continue
            verdict = "" if budget_ms is None else (" meets" if row.p99_ms <= budget_ms else " misses")
            parts.append(f"{labels[id(scenario)]} {row.p99_ms:.2f} ms{verdict}")
        if parts:
            lines.append(f"  c={concurrency}: {', '.join(parts)}")
    return lines


def _throughput(scenarios: Sequence[Scenario], labels: dict[int, str]) -> tuple[dict[str, dict[int, float]],
                                                                                 list[str]]:
    """Served throughput over direct throughput, per served scenario and concurrency."""
    direct = next((s for s in scenarios if s.name == "direct"), None)
    if direct is None:
        return {}, ["served/direct throughput: not available (no direct scenario)"]
    ratios: dict[str, dict[int, float]] = {}
    lines = ["served/direct throughput by concurrency:"]
    for concurrency in _concurrencies(scenarios):
        base = _row(direct, concurrency)
        if base is None or not base.throughput_per_s:
            continue
        parts = [f"direct {_rate(base.throughput_per_s)}"]
        for scenario in scenarios:
            row = _row(scenario, concurrency)
            if scenario is direct or row is None or row.throughput_per_s is None:
                continue
            ratio = row.throughput_per_s / base.throughput_per_s
            ratios.setdefault(labels[id(scenario)], {})[concurrency] = ratio
            parts.append(f"{labels[id(scenario)]} {_rate(row.throughput_per_s)} = {ratio:.2f}x")
        lines.append(f"  c={concurrency}: {', '.join(parts)}")
    return ratios, lines


def _rate(per_s: float) -> str:
    return f"{per_s:,.0f}/s" if per_s >= 100 else f"{per_s:.3g}/s"


def _memory(result: CompareResult, missing: list[str]) -> tuple[float | None, list[str]]:
    """Memory per extra model = (server peak with N+1 models - server peak with one) / N."""
    parts = []
    for name, label in (("direct", "direct process"), ("served", "server, 1 model"),
                        ("served_with_others", "server, {models} models")):
        memory = result.memory.get(name)
        if memory is None or memory.peak_mb is None:
            continue
        text = label.format(models=memory.models if memory.models is not None else "several")
        source = "" if memory.source == "memory_mb" else f", from {memory.source}"
        idle = f"idle {memory.idle_mb:,.0f} MB, " if memory.idle_mb is not None else ""
        parts.append(f"{text}: {idle}peak {memory.peak_mb:,.0f} MB{source}")
    served, others = result.memory.get("served"), result.memory.get("served_with_others")
    per_extra = None
    if served and others and served.peak_mb is not None and others.peak_mb is not None:
        if others.models is not None and others.models > 1:
            per_extra = (others.peak_mb - served.peak_mb) / (others.models - 1)
        else:
            missing.append("memory_mb.served_with_others.models (how many models the server held)")
    lines = [f"memory (RSS): {'; '.join(parts)}"] if parts else ["memory: not measured"]
    if per_extra is not None:
        lines.append(f"memory per extra model in the server: {per_extra:,.0f} MB")
    return per_extra, lines


def _batching(result: CompareResult, missing: list[str]) -> tuple[dict[int, float], list[str]]:
    """Throughput with dynamic batching over throughput without it, where a scenario was measured both ways."""
    for name in ("served", "served_with_others"):
        on = next((s for s in result.named(name) if s.batching), None)
        off = next((s for s in result.named(name) if s.batching is False), None)
        if on is None or off is None:
            continue
        gain: dict[int, float] = {}
        for row in on.rows:
            other = _row(off, row.concurrency)
            if row.throughput_per_s and other is not None and other.throughput_per_s:
                gain[row.concurrency] = row.throughput_per_s / other.throughput_per_s - 1
        parts = [f"{value:+.0%} at c={c} ({_batching_word(value)})" for c, value in sorted(gain.items())]
        return gain, [f"dynamic batching ({name.replace('_', ' ')} throughput, on vs off): {', '.join(parts)}"]
    missing.append("a served scenario measured with dynamic batching off and on (what batching adds)")
    return {}, ["dynamic batching: not measured both ways"]


def _together_lines(scenarios: Sequence[Scenario], labels: dict[int, str]) -> list[str]:
    """What all the models of a server answered together, against one model alone with the same batching (from
    the server's statistics; results written before compare recorded them have none)."""
    lines = []
    for scenario in scenarios:
        if scenario.name != "served_with_others":
            continue
        alone = next((s for s in scenarios if s.name == "served" and s.batching == scenario.batching), None)
        parts = []
        for row in scenario.rows:
            base = _row(alone, row.concurrency) if alone is not None else None
            if row.together_per_s is None or base is None or not base.together_per_s:
                continue
            parts.append(f"{_rate(row.together_per_s)} = {row.together_per_s / base.together_per_s:.2f}x at "
                         f"c={row.concurrency}")
        if parts:
            lines.append(f"{labels[id(scenario)]}, all models together vs one model alone: {', '.join(parts)}")
    return lines


def _batching_word(gain: float) -> str:
    if gain > NOISE:
        return "helped"
    return "hurt" if gain < -NOISE else "within noise"


def _point(variants: Sequence[Scenario], labels: dict[int, str], concurrency: int) -> Point | None:
    """The variant with the lowest p99 at the smallest measured concurrency >= the expected one (else the largest)."""
    points = []
    for scenario in variants:
        if not scenario.rows:
            continue
        row = next((r for r in scenario.rows if r.concurrency >= concurrency), scenario.rows[-1])
        points.append(Point(label=labels[id(scenario)], concurrency=row.concurrency, p99_ms=row.p99_ms,
                            throughput_per_s=row.throughput_per_s, cpu=row.cpu, batch_rows=row.batch_rows))
    measured = [p for p in points if p.p99_ms is not None]
    if measured:
        return min(measured, key=lambda p: p.p99_ms or 0.0)
    return points[0] if points else None


def _limit_lines(served: Point | None) -> list[str]:
    """What the served point's CPU figures say stopped it, where kiln bench measured them."""
    if served is None or served.cpu is None:
        return []
    cpu = served.cpu
    loop = cpu.busiest_thread if cpu.main_thread is None else cpu.main_thread
    if loop >= SATURATED:
        which = ("one thread of the server process (its event loop, or on a GPU host the thread that waits for the "
                 "device)" if cpu.main_thread is None else "the server process's event loop")
        limit = (f"{which} was busy {loop:.2f} of a core (Python work per request, which more cores do not speed "
                 f"up; the machine was {cpu.machine_idle_pct:.0f}% idle)")
    elif cpu.busiest_child >= SATURATED:
        limit = (f"one frontend worker process was busy {cpu.busiest_child:.2f} of a core (clients that share one "
                 f"connection reach one worker: gRPC channels, for instance)")
    elif cpu.machine_idle_pct < BUSY_MACHINE_PCT:
        limit = f"the machine's cores were busy ({cpu.machine_idle_pct:.0f}% idle), clients included"
    else:
        limit = ("no thread, worker or core was saturated: the limit is outside the server's CPU (the device, the "
                 "clients, or waits between them)")
    batches = "" if served.batch_rows is None else f"; the server ran batches of {served.batch_rows:.1f} rows there"
    return [f"what limited {served.label} at c={served.concurrency}: {limit}{batches}"]


def _expected_lines(concurrency: int, points: Sequence[Point | None]) -> list[str]:
    lines = []
    for point in points:
        if point is not None and point.concurrency != concurrency:
            where = "above" if point.concurrency > concurrency else "below"
            lines.append(f"{point.label}: no row at the expected concurrency {concurrency}; the rules use "
                         f"c={point.concurrency}, the nearest measured {where} it")
    return lines
