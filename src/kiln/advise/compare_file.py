"""Reading a ``kiln bench compare`` result into typed records.

Only what the advice needs is read. Optional parts that are absent (a scenario, a memory entry, a percentile) are
listed in ``CompareResult.missing`` so the answer can say what it could not use; a file that is not a compare
result at all (not JSON, no scenarios, a field of the wrong type) raises :class:`InvalidArgumentError`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import InvalidArgumentError

SCENARIOS = ("direct", "served", "served_with_others")
EXPECTED = ('a JSON object written by `kiln bench compare`: {"model": ..., "scenarios": [{"name": "direct" | '
            '"served" | "served_with_others", "batching": bool, "models_loaded": int, "results": [...]}], '
            '"memory_mb": {...}}')


@dataclass(frozen=True)
class Row:
    """One concurrency level of one scenario. Throughput is items/s, or inferences/s when items are absent."""

    concurrency: int
    throughput_per_s: float | None
    p99_ms: float | None
    stable: bool | None
    rss_idle_mb: float | None = None
    rss_peak_mb: float | None = None
    together_per_s: float | None = None  # every model the server held, from its statistics (served rows)
    cpu: Cpu | None = None  # of the process under test while the level ran (kiln bench's ``cpu``)
    batch_rows: float | None = None  # the measured model's rows per execution on the server (served rows)


@dataclass(frozen=True)
class Cpu:
    """Cores used on average: the process's busiest thread, the busiest of its child processes; the machine's idle
    share in percent; the process's main thread (its event loop; None in files written before it was measured)."""

    busiest_thread: float
    busiest_child: float
    machine_idle_pct: float
    main_thread: float | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    batching: bool | None
    models_loaded: int | None
    rows: tuple[Row, ...]


@dataclass(frozen=True)
class Memory:
    """Process memory of one scenario; ``source`` says whether it came from ``memory_mb`` or the per-row samples."""

    idle_mb: float | None
    peak_mb: float | None
    models: int | None
    source: str


@dataclass(frozen=True)
class CompareResult:
    path: Path
    model: str | None
    machine: str | None
    scenarios: tuple[Scenario, ...]
    memory: Mapping[str, Memory]
    missing: tuple[str, ...]
    ignored: tuple[str, ...]

    def named(self, name: str) -> tuple[Scenario, ...]:
        return tuple(s for s in self.scenarios if s.name == name)


class _Reader:
    """Walks the parsed JSON, collecting what is missing and failing on what is malformed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.missing: list[str] = []
        self.ignored: list[str] = []

    def fail(self, where: str, problem: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"--evidence {self.path}: {where} {problem}; expected {EXPECTED}")

    def number(self, obj: Mapping[str, Any], key: str, where: str) -> float | None:
        value = obj.get(key)
        if value is None:
            self.missing.append(f"{where}.{key}")
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(f"{where}.{key}", f"is {value!r}, not a number")
        return float(value)

    def optional_int(self, obj: Mapping[str, Any], key: str, where: str) -> int | None:
        value = obj.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"{where}.{key}", f"is {value!r}, not a whole number")
        return value

    def optional_bool(self, obj: Mapping[str, Any], key: str, where: str) -> bool | None:
        value = obj.get(key)
        if value is not None and not isinstance(value, bool):
            raise self.fail(f"{where}.{key}", f"is {value!r}, not true or false")
        return value

    def mapping(self, value: object, where: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.fail(where, f"is {type(value).__name__}, not an object")
        return value

    def sequence(self, value: object, where: str) -> Sequence[Any]:
        if not isinstance(value, list):
            raise self.fail(where, f"is {type(value).__name__}, not a list")
        return value


def load_compare(path: Path) -> CompareResult:
    """Read and check a compare result file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidArgumentError(f"--evidence {path}: cannot read the file ({exc.strerror or exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"--evidence {path}: not JSON (line {exc.lineno}, column {exc.colno}: "
                                   f"{exc.msg}); expected {EXPECTED}") from None
    return parse_compare(data, path)


def parse_compare(data: object, path: Path) -> CompareResult:
    reader = _Reader(path)
    top = reader.mapping(data, "the file")
    if "scenarios" not in top:
        raise reader.fail("the file", "has no 'scenarios'")
    model = top.get("model")
    scenarios = _scenarios(reader, reader.sequence(top["scenarios"], "scenarios"),
                           str(model) if model is not None else None)
    if not scenarios:
        raise reader.fail("scenarios", f"holds none of {', '.join(SCENARIOS)}")
    for name in SCENARIOS:
        if not any(s.name == name for s in scenarios):
            reader.missing.append(f"scenario {name}")
    memory = _memory(reader, top.get("memory_mb"), scenarios)
    if model is None:
        reader.missing.append("model")
    return CompareResult(path=path, model=str(model) if model is not None else None,
                         machine=_machine(top.get("machine")), scenarios=scenarios, memory=memory,
                         missing=tuple(reader.missing), ignored=tuple(reader.ignored))


def _scenarios(reader: _Reader, items: Sequence[Any], model: str | None) -> tuple[Scenario, ...]:
    scenarios: list[Scenario] = []
    for index, item in enumerate(items):
        where = f"scenarios[{index}]"
        obj = reader.mapping(item, where)
        name = obj.get("name")
        if not isinstance(name, str):
            raise reader.fail(f"{where}.name", f"is {name!r}, not one of {', '.join(SCENARIOS)}")
        if name not in SCENARIOS:
            reader.ignored.append(f"{where}: unknown scenario '{name}'")
            continue
        batching = reader.optional_bool(obj, "batching", where)
        if any(s.name == name and s.batching == batching for s in scenarios):
            reader.ignored.append(f"{where}: a second '{name}' scenario with batching={batching}")
            continue
        if "results" not in obj:
            raise reader.fail(where, "has no 'results'")
        label = name if batching is None else f"{name}[{'batching' if batching else 'no batching'}]"
        rows = _rows(reader, reader.sequence(obj["results"], f"{where}.results"), label, model)
        scenarios.append(Scenario(name=name, batching=batching,
                                  models_loaded=reader.optional_int(obj, "models_loaded", where), rows=rows))
    return tuple(scenarios)


def _rows(reader: _Reader, items: Sequence[Any], scenario: str, model: str | None) -> tuple[Row, ...]:
    rows: list[Row] = []
    for index, item in enumerate(items):
        where = f"{scenario}.results[{index}]"
        obj = reader.mapping(item, where)
        concurrency = reader.optional_int(obj, "concurrency", where)
        if concurrency is None:
            reader.ignored.append(f"{where}: no concurrency (a request-rate row)")
            continue
        if any(r.concurrency == concurrency for r in rows):
            reader.ignored.append(f"{where}: a second row for concurrency {concurrency}")
            continue
        where = f"{scenario} c={concurrency}"
        throughput = (reader.number(obj, "throughput_items_per_s", where) if "throughput_items_per_s" in obj
                      else reader.number(obj, "throughput_infer_per_s", where))
        latency = obj.get("latency_ms")
        if latency is None:
            reader.missing.append(f"{where}.latency_ms")
            p99 = None
        else:
            p99 = reader.number(reader.mapping(latency, f"{where}.latency_ms"), "p99", f"{where}.latency_ms")
        idle, peak = _row_memory(reader, obj.get("memory_mb"), where)
        rows.append(Row(concurrency=concurrency, throughput_per_s=throughput, p99_ms=p99,
                        stable=reader.optional_bool(obj, "stable", where), rss_idle_mb=idle, rss_peak_mb=peak,
                        together_per_s=_together(reader, obj, where), cpu=_cpu(reader, obj.get("cpu"), where),
                        batch_rows=_batch_rows(reader, obj, where, model)))
    return tuple(sorted(rows, key=lambda r: r.concurrency))


def _batch_rows(reader: _Reader, row: Mapping[str, Any], where: str, model: str | None) -> float | None:
    """The measured model's rows per execution (``server_rows_per_execution``); None in files without it."""
    value = row.get("server_rows_per_execution")
    if value is None or model is None:
        return None
    batches = reader.mapping(value, f"{where}.server_rows_per_execution")
    return reader.number(batches, model, f"{where}.server_rows_per_execution") if model in batches else None


def _together(reader: _Reader, row: Mapping[str, Any], where: str) -> float | None:
    """The sum of ``server_models_per_s`` (requests/s per model name); None where a result has no such counts, or
    counts made before compare matched them to the kept windows (rows without ``window_span_ns``): those spread
    each level's start-up over the rate and put one model alone far below what its clients measured."""
    value = row.get("server_models_per_s")
    if value is None:
        return None
    if row.get("window_span_ns") is None:
        reader.ignored.append(f"{where}.server_models_per_s: counted over the whole level, not the kept windows (a "
                              f"file from before window_span_ns)")
        return None
    rates = reader.mapping(value, f"{where}.server_models_per_s")
    total = 0.0
    for name in rates:
        rate = reader.number(rates, name, f"{where}.server_models_per_s")
        total += rate or 0.0
    return total


def _cpu(reader: _Reader, value: object, where: str) -> Cpu | None:
    """A row's CPU figures; None in files written before kiln bench measured them."""
    if value is None:
        return None
    obj = reader.mapping(value, f"{where}.cpu")
    thread = reader.number(obj, "busiest_thread", f"{where}.cpu")
    idle = reader.number(obj, "machine_idle_pct", f"{where}.cpu")
    child = reader.number(obj, "busiest_child", f"{where}.cpu") if "busiest_child" in obj else 0.0
    main = reader.number(obj, "main_thread", f"{where}.cpu") if obj.get("main_thread") is not None else None
    if thread is None or idle is None or child is None:
        return None
    return Cpu(busiest_thread=thread, busiest_child=child, machine_idle_pct=idle, main_thread=main)


def _row_memory(reader: _Reader, value: object, where: str) -> tuple[float | None, float | None]:
    """The per-row RSS samples a plain ``kiln bench`` result carries; a fallback for a missing ``memory_mb``."""
    if value is None:
        return None, None
    obj = reader.mapping(value, f"{where}.memory_mb")
    numbers = []
    for key in ("rss_idle", "rss_peak"):
        item = obj.get(key)
        if item is not None and (isinstance(item, bool) or not isinstance(item, (int, float))):
            raise reader.fail(f"{where}.memory_mb.{key}", f"is {item!r}, not a number")
        numbers.append(float(item) if item is not None else None)
    return numbers[0], numbers[1]


def _memory(reader: _Reader, value: object, scenarios: tuple[Scenario, ...]) -> dict[str, Memory]:
    top = reader.mapping(value, "memory_mb") if value is not None else {}
    memory: dict[str, Memory] = {}
    for name in SCENARIOS:
        present = [s for s in scenarios if s.name == name]
        entry = top.get(name)
        if entry is not None:
            obj = reader.mapping(entry, f"memory_mb.{name}")
            models = reader.optional_int(obj, "models", f"memory_mb.{name}")
            memory[name] = Memory(idle_mb=reader.number(obj, "idle", f"memory_mb.{name}"),
                                  peak_mb=reader.number(obj, "peak", f"memory_mb.{name}"),
                                  models=models if models is not None else _models_loaded(present), source="memory_mb")
            continue
        from_rows = _memory_from_rows(present)
        if from_rows is not None:
            memory[name] = from_rows
        elif present:
            reader.missing.append(f"memory_mb.{name}")
    return memory


def _memory_from_rows(scenarios: Sequence[Scenario]) -> Memory | None:
    rows = [r for s in scenarios for r in s.rows]
    peaks = [r.rss_peak_mb for r in rows if r.rss_peak_mb is not None]
    idles = [r.rss_idle_mb for r in rows if r.rss_idle_mb is not None]
    if not peaks:
        return None
    return Memory(idle_mb=min(idles) if idles else None, peak_mb=max(peaks), models=_models_loaded(scenarios),
                  source="per-row samples")


def _models_loaded(scenarios: Sequence[Scenario]) -> int | None:
    counts = [s.models_loaded for s in scenarios if s.models_loaded is not None]
    return max(counts) if counts else None


def _machine(value: object) -> str | None:
    """A one-line description from the scalar fields of ``machine`` (its keys are the bench tool's choice)."""
    if not isinstance(value, Mapping):
        return None
    parts = [f"{key} {item}" for key, item in value.items() if isinstance(item, (str, int, float)) and item != ""]
    return ", ".join(parts) or None
