"""The text kiln bench prints on stdout: a block per load level (laid out like perf_analyzer's) and a summary."""

from __future__ import annotations

from kiln.bench.options import BenchOptions
from kiln.bench.result import BenchResult, LevelResult


def header(options: BenchOptions) -> str:
    if options.target in ("http", "grpc"):
        where = f" at {options.url}" if options.url else " (a `kiln serve` kiln bench starts)"
    else:
        where = ""
    return (f"*** kiln bench: model '{options.model}', target {options.target}{where}, batch size "
            f"{options.batch_size} ***\n  windows of {options.measurement_interval_ms} ms, stable when the last 3 "
            f"agree within {options.stability_percentage:g} %, at most {options.max_trials} windows per level\n")


def level_block(level: LevelResult) -> str:
    title = (f"Request concurrency: {level.concurrency}" if level.concurrency is not None
             else f"Request rate: {level.request_rate:g} requests/sec")
    latency = level.latency_ms
    lines = [
        title,
        *([f"  Load generator: {level.load_generator}"] if level.load_generator != "kiln" else []),
        "  Client:",
        f"    Request count: {level.requests}",
        f"    Throughput: {level.throughput_infer_per_s:.1f} infer/sec ({level.throughput_items_per_s:.1f} items/sec)",
        f"    Avg latency: {_us(latency.avg)} usec",
        *(f"    p{p} latency: {_us(getattr(latency, f'p{p}'))} usec" for p in (50, 90, 95, 99)),
    ]
    if level.client_ms is not None:
        wait = max(0.0, latency.avg - level.client_ms.send - level.client_ms.recv)
        lines.append(f"    Avg client time: send {_us(level.client_ms.send)} usec + response wait {_us(wait)} usec + "
                     f"recv {_us(level.client_ms.recv)} usec")
    if level.sends is not None:
        lines.append(f"    Sends: {level.sends.scheduled} scheduled, {level.sends.delayed} delayed, "
                     f"{level.sends.dropped} dropped")
    if level.server_us is not None:
        s = level.server_us
        lines += ["  Server:", f"    Avg request time: {s.total:.0f} usec (queue {s.queue:.0f} + compute input "
                               f"{s.compute_input:.0f} + compute infer {s.compute_infer:.0f} + compute output "
                               f"{s.compute_output:.0f})"]
    m = level.memory_mb
    lines.append(f"  Memory: RSS idle {_mib(m.rss_idle)}, peak {_mib(m.rss_peak)}; GPU idle {_mib(m.gpu_idle)}, "
                 f"peak {_mib(m.gpu_peak)}")
    if level.cpu is not None:
        c = level.cpu
        main = "" if c.main_thread is None else f"its main thread {c.main_thread:.2f}, "
        lines.append(f"  CPU (cores): process {c.process:.2f}, {main}its busiest thread {c.busiest_thread:.2f}, "
                     f"its children {c.children:.2f} (busiest {c.busiest_child:.2f}); machine "
                     f"{c.machine_idle_pct:.0f}% idle")
    lines.append(f"  {'Stable' if level.stable else 'NOT stable'} after {level.windows} window(s); "
                 f"errors: {level.errors}")
    return "\n".join(lines) + "\n"


SUMMARY_COLUMNS = ("load", "infer/s", "items/s", "avg ms", "p50 ms", "p90 ms", "p95 ms", "p99 ms", "errors",
                   "stable")


def summary(result: BenchResult) -> str:
    rows = [[_load(level), f"{level.throughput_infer_per_s:.1f}", f"{level.throughput_items_per_s:.1f}",
             *(f"{getattr(level.latency_ms, key):.3f}" for key in ("avg", "p50", "p90", "p95", "p99")),
             str(level.errors), "yes" if level.stable else "no"] for level in result.results]
    cells = [list(SUMMARY_COLUMNS), *rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(SUMMARY_COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "Summary\n" + "\n".join(lines) + "\n"


def _load(level: LevelResult) -> str:
    return f"c={level.concurrency}" if level.concurrency is not None else f"{level.request_rate:g}/s"


def _us(ms: float) -> str:
    return f"{ms * 1000:.0f}"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} MiB"
