"""A bench run's results and their JSON and CSV forms.

The JSON keys are a contract other tools read (``kiln bench compare``, ``kiln advise``); new keys may be added,
existing ones keep their names and meaning. Latencies are client-side in milliseconds, server phases per request
in microseconds, memory in MiB (2**20 bytes). ``throughput_infer_per_s`` counts requests; ``throughput_items_per_s``
counts batch items (requests x batch size), which is what perf_analyzer calls infer/sec.

The CSV starts with perf_analyzer's 13 columns, with its meanings (Inferences/Second counts batch items; times in
microseconds), so its spreadsheets take the file; kiln's columns follow.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.bench.measure import Measurement
from kiln.bench.resources import CpuFigures, MemoryFigures
from kiln.bench.schedule import SendCounts


@dataclass(frozen=True)
class Latency:
    avg: float
    p50: float
    p90: float
    p95: float
    p99: float


@dataclass(frozen=True)
class ClientTimesMs:
    send: float
    recv: float


@dataclass(frozen=True)
class ServerTimesUs:
    queue: float
    compute_input: float
    compute_infer: float
    compute_output: float

    @property
    def total(self) -> float:
        return self.queue + self.compute_input + self.compute_infer + self.compute_output


@dataclass(frozen=True)
class LevelResult:
    concurrency: int | None
    request_rate: float | None
    throughput_infer_per_s: float
    throughput_items_per_s: float
    latency_ms: Latency
    client_ms: ClientTimesMs | None
    server_us: ServerTimesUs | None
    stable: bool
    windows: int
    errors: int
    memory_mb: MemoryFigures
    requests: int = 0  # counted in the merged windows
    duration_s: float = 0.0  # of the merged windows
    sends: SendCounts | None = None  # request-rate mode only
    # The merged windows' start and end (time.monotonic_ns of the measuring process): counts read elsewhere, such
    # as every model's on the server, can be matched to exactly the time the figures above cover.
    window_span_ns: tuple[int, int] | None = None
    load_generator: str = "kiln"  # what sent the requests: kiln's own client or perf_analyzer
    cpu: CpuFigures | None = None  # of the process under test while the level ran

    @classmethod
    def from_measurement(cls, measured: Measurement, batch_size: int) -> LevelResult:
        latency = measured.latency
        ms = latency.as_ms() if latency is not None else dict.fromkeys(("avg", "p50", "p90", "p95", "p99"), 0.0)
        client = None
        if measured.client_send_ns is not None and measured.client_recv_ns is not None:
            client = ClientTimesMs(measured.client_send_ns / 1e6, measured.client_recv_ns / 1e6)
        server = ServerTimesUs(**measured.server.per_request_us()) if measured.server is not None else None
        rate = measured.throughput_per_s
        return cls(concurrency=measured.level.concurrency, request_rate=measured.level.request_rate,
                   throughput_infer_per_s=rate, throughput_items_per_s=rate * batch_size, latency_ms=Latency(**ms),
                   client_ms=client, server_us=server, stable=measured.stable, windows=measured.windows,
                   errors=measured.errors, memory_mb=measured.memory, requests=measured.requests,
                   duration_s=measured.duration_ns / 1e9, sends=measured.sends, window_span_ns=measured.span_ns)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> LevelResult:
        def optional(key: str, kind: Any) -> Any:
            value = doc.get(key)
            return kind(**value) if value is not None else None

        return cls(concurrency=doc["concurrency"], request_rate=doc["request_rate"],
                   throughput_infer_per_s=doc["throughput_infer_per_s"],
                   throughput_items_per_s=doc["throughput_items_per_s"], latency_ms=Latency(**doc["latency_ms"]),
                   client_ms=optional("client_ms", ClientTimesMs), server_us=optional("server_us", ServerTimesUs),
                   stable=doc["stable"], windows=doc["windows"], errors=doc["errors"],
                   memory_mb=MemoryFigures(**doc["memory_mb"]), requests=doc.get("requests", 0),
                   duration_s=doc.get("duration_s", 0.0), sends=optional("sends", SendCounts),
                   window_span_ns=tuple(doc["window_span_ns"]) if doc.get("window_span_ns") else None,
                   load_generator=doc.get("load_generator", "kiln"), cpu=optional("cpu", CpuFigures))

    @property
    def network_us(self) -> float | None:
        """Latency not spent in client send/recv or in the server's phases (network, codecs, server overhead)."""
        if self.server_us is None:
            return None
        client_ms = self.client_ms.send + self.client_ms.recv if self.client_ms is not None else 0.0
        return max(0.0, (self.latency_ms.avg - client_ms) * 1000.0 - self.server_us.total)


@dataclass(frozen=True)
class BenchResult:
    model: str
    target: str
    url: str | None
    batch_size: int
    machine: dict[str, Any]
    results: list[LevelResult]
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> BenchResult:
        return cls(model=doc["model"], target=doc["target"], url=doc["url"], batch_size=doc["batch_size"],
                   machine=doc.get("machine", {}), results=[LevelResult.from_dict(r) for r in doc["results"]],
                   options=doc.get("options", {}))

    @classmethod
    def from_json(cls, text: str) -> BenchResult:
        return cls.from_dict(json.loads(text))

    def to_csv(self) -> str:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        for level in self.results:
            writer.writerow(_csv_row(level))
        return out.getvalue()

    def write_json(self, path: Path) -> None:
        path.write_text(self.to_json(), encoding="utf-8")

    def write_csv(self, path: Path) -> None:
        path.write_text(self.to_csv(), encoding="utf-8")


CSV_COLUMNS = (
    # perf_analyzer's columns, its meanings
    "Concurrency", "Inferences/Second", "Client Send", "Network+Server Send/Recv", "Server Queue",
    "Server Compute Input", "Server Compute Infer", "Server Compute Output", "Client Recv",
    "p50 latency", "p90 latency", "p95 latency", "p99 latency",
    # kiln's
    "Request Rate", "Requests/Second", "Avg latency", "Requests", "Errors", "Stable", "Windows",
    "RSS Idle MiB", "RSS Peak MiB", "GPU Idle MiB", "GPU Peak MiB", "Sends Delayed", "Sends Dropped",
    "Load Generator",
)


def _us(value_ms: float | None) -> int | str:
    return "" if value_ms is None else round(value_ms * 1000)


def _cell(value: float | int | None) -> float | int | str:
    return "" if value is None else value


def _csv_row(level: LevelResult) -> list[object]:
    client, server, latency, memory = level.client_ms, level.server_us, level.latency_ms, level.memory_mb
    server_cells: list[object] = ["", "", "", ""] if server is None else [
        round(server.queue), round(server.compute_input), round(server.compute_infer), round(server.compute_output)]
    network = level.network_us
    return [
        _cell(level.concurrency), round(level.throughput_items_per_s, 2), _us(client.send if client else None),
        "" if network is None else round(network), *server_cells, _us(client.recv if client else None),
        _us(latency.p50), _us(latency.p90), _us(latency.p95), _us(latency.p99),
        _cell(level.request_rate), round(level.throughput_infer_per_s, 2), _us(latency.avg), level.requests,
        level.errors, level.stable, level.windows, _cell(memory.rss_idle), _cell(memory.rss_peak),
        _cell(memory.gpu_idle), _cell(memory.gpu_peak), _cell(level.sends.delayed if level.sends else None),
        _cell(level.sends.dropped if level.sends else None), level.load_generator,
    ]
