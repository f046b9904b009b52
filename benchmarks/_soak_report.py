"""The soak test's results (benchmarks/soak.py): the per-window time series, the summary with the bar's criteria,
the text report and the plot."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _common import cell, table

FLAT_WITHIN = 0.05  # RSS and descriptors: the largest later sample within 5% of the end of the warm-up
P99_WITHIN = 1.5  # every later window's p99 within 1.5x of the warm-up's


@dataclass(frozen=True)
class Criteria:
    warmup_windows: int
    shm_slack: int  # shared-memory regions the clients may hold at once beyond the end of the warm-up


def outages(events: list[dict[str, Any]], model: str) -> list[tuple[float, float]]:
    """The intervals (monotonic seconds) in which ``model`` was unloaded on purpose: from just before each unload
    call to the return of the next load call that succeeded (the end of time when none did)."""
    spans, down_since = [], None
    for event in sorted((e for e in events if e.get("model") == model), key=lambda e: e["start"]):
        if event["action"] == "unload" and down_since is None:
            down_since = event["start"]
        elif event["action"] == "load" and down_since is not None and event["error"] is None:
            spans.append((down_since, event["end"]))
            down_since = None
    if down_since is not None:
        spans.append((down_since, float("inf")))
    return spans


def _by_design(failure: dict[str, Any], toggled: str, spans: list[tuple[float, float]]) -> bool:
    return failure["model"] == toggled and any(failure["start"] <= end and failure["end"] >= start
                                               for start, end in spans)


def _latencies(records: list[dict[str, Any]]) -> list[float]:
    return [value for record in records for values in record["latencies_ms"].values() for value in values]


def _percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def _by_window(client_windows: list[dict[str, Any]], windows: int) -> list[list[dict[str, Any]]]:
    """The clients' records grouped by window; stragglers after the last window count in the last."""
    grouped: list[list[dict[str, Any]]] = [[] for _ in range(windows)]
    for record in client_windows:
        grouped[min(max(record["window"], 0), windows - 1)].append(record)
    return grouped


def _p99_by_operation(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """Which traffic a slow window slowed: each operation's p99 in it."""
    merged: dict[str, list[float]] = defaultdict(list)
    for record in records:
        for operation, values in record["latencies_ms"].items():
            merged[operation].extend(values)
    return {operation: _percentile(values, 99) for operation, values in sorted(merged.items())}


def merge_windows(samples: list[dict[str, Any]], client_windows: list[dict[str, Any]], events: list[dict[str, Any]],
                  windows: int, window_s: float, toggled: str) -> list[dict[str, Any]]:
    """One row per window: the server sample taken at its end and what the clients saw in it."""
    spans = outages(events, toggled)
    at_end = {sample["window"]: sample for sample in samples}
    series = []
    for index, records in enumerate(_by_window(client_windows, windows)):
        latencies = _latencies(records)
        failures = [f for record in records for f in record["failures"]]
        by_design = sum(_by_design(f, toggled, spans) for f in failures)
        sample = {k: v for k, v in at_end.get(index, {}).items() if k != "window"}
        series.append({"window": index, "t_end_s": round((index + 1) * window_s, 1), **sample,
                       "requests": sum(sum(r["ok"].values()) + r["wrong"] + r["failed"] for r in records),
                       "p50_ms": _percentile(latencies, 50), "p99_ms": _percentile(latencies, 99),
                       "p99_ms_by_operation": _p99_by_operation(records),
                       "wrong": sum(r["wrong"] for r in records), "failed": len(failures) - by_design,
                       "unavailable_by_design": by_design,
                       "chaos": dict(sum((Counter(r["chaos"]) for r in records), Counter())),
                       "versions": dict(sum((Counter(r["versions"]) for r in records), Counter()))})
    return series


def summarize(series: list[dict[str, Any]], client_windows: list[dict[str, Any]], events: list[dict[str, Any]],
              criteria: Criteria, toggled: str, server_exit: int | None = None) -> dict[str, Any]:
    """Totals, per-operation latency, and each criterion of the bar with PASS or FAIL."""
    warm = criteria.warmup_windows
    grouped = _by_window(client_windows, len(series))
    baseline_windows = grouped[1:warm] if warm >= 2 else grouped[:1]  # the first window is a cold start
    baseline_p99 = _percentile(_latencies([r for records in baseline_windows for r in records]), 99)
    spans = outages(events, toggled)
    failures = [f for r in client_windows for f in r["failures"] if not _by_design(f, toggled, spans)]
    control_errors = [e for e in events if e["error"]]
    checks = [
        {"name": "the server stayed up", "passed": server_exit is None,
         "detail": "yes" if server_exit is None else f"it exited with status {server_exit} mid-run"},
        _flat("RSS", series, warm, "rss_mib", " MiB"),
        _flat("open descriptors", series, warm, "fds", ""),
        _shm_flat(series, warm, criteria.shm_slack),
        _p99_check(series, warm, baseline_p99),
        _zero("wrong answers", sum(r["wrong"] for r in client_windows),
              [w for r in client_windows for w in r["wrong_answers"]][:5]),
        _zero("failed well-formed requests", len(failures),
              [f"{f['operation']} ({f['model']}): {f['message']}" for f in failures][:5]),
        _zero("failed publish/unload/load actions", len(control_errors),
              [f"{e['action']} {e.get('model')}: {e['error']}" for e in control_errors][:5]),
    ]
    operations: dict[str, list[float]] = {}
    for record in client_windows:
        for operation, values in record["latencies_ms"].items():
            operations.setdefault(operation, []).extend(values)
    return {
        "passed": all(check["passed"] for check in checks),
        "criteria": checks,
        "requests": sum(row["requests"] for row in series),
        "wrong_answers": sum(row["wrong"] for row in series),
        "failed_requests": len(failures),
        "unavailable_by_design": sum(row["unavailable_by_design"] for row in series),
        "warmup_p99_ms": baseline_p99,
        "operations": {name: {"answers": len(values), "p50_ms": _percentile(values, 50),
                              "p99_ms": _percentile(values, 99), "max_ms": round(max(values), 3)}
                       for name, values in sorted(operations.items())},
        "chaos": dict(sum((Counter(row["chaos"]) for row in series), Counter())),
        "versions": dict(sum((Counter(row["versions"]) for row in series), Counter())),
        "actions": dict(Counter(e["action"] for e in events)),
        "server_cpu_pct_mean": _mean([row.get("cpu_pct") for row in series]),
    }


def _mean(values: list[Any]) -> float | None:
    numbers = [v for v in values if v is not None]
    return round(sum(numbers) / len(numbers), 1) if numbers else None


def _flat(name: str, series: list[dict[str, Any]], warm: int, key: str, unit: str) -> dict[str, Any]:
    start = series[warm - 1].get(key)
    later = [row[key] for row in series[warm:] if row.get(key) is not None]
    if start is None or not later:
        return {"name": f"{name} flat", "passed": False, "detail": "not sampled"}
    peak = max(later)
    growth = peak / start - 1 if start else 0.0
    return {"name": f"{name} flat within {FLAT_WITHIN:.0%}", "passed": growth <= FLAT_WITHIN,
            "detail": f"end of warm-up {cell(start)}{unit}, largest later {cell(peak)}{unit} ({growth:+.1%})",
            "end_of_warmup": start, "peak_after": peak}


def _shm_flat(series: list[dict[str, Any]], warm: int, slack: int) -> dict[str, Any]:
    name = "shared-memory mappings flat"
    start = series[warm - 1].get("shm_mapped")
    later = [row["shm_mapped"] for row in series[warm:] if row.get("shm_mapped") is not None]
    if start is None or not later:
        return {"name": name, "passed": False, "detail": "not sampled"}
    return {"name": name, "passed": max(later) <= start + slack,
            "detail": f"end of warm-up {start}, largest later {max(later)} (allowed {start + slack}: the clients' "
                      f"regions in rotation)"}


def _p99_check(series: list[dict[str, Any]], warm: int, baseline: float | None) -> dict[str, Any]:
    name = f"p99 of every later window within {P99_WITHIN}x of the warm-up's"
    later = [(row["window"], row["p99_ms"]) for row in series[warm:]]
    if baseline is None or not later or any(p99 is None for _, p99 in later):
        return {"name": name, "passed": False, "detail": "a window without answers"}
    worst_window, worst = max(later, key=lambda item: item[1])
    return {"name": name, "passed": worst <= P99_WITHIN * baseline,
            "detail": f"warm-up p99 {baseline:.2f} ms, worst later window {worst_window} at {worst:.2f} ms "
                      f"({worst / baseline:.2f}x)"}


def _zero(name: str, count: int, examples: list[Any]) -> dict[str, Any]:
    detail = f"{count:,}" + ("; e.g. " + "; ".join(str(e) for e in examples) if examples else "")
    return {"name": f"zero {name}", "passed": count == 0, "detail": detail, "count": count}


def text_report(series: list[dict[str, Any]], summary: dict[str, Any], events: list[dict[str, Any]]) -> str:
    rows = [[row["t_end_s"], row.get("rss_mib"), row.get("fds"), row.get("threads"), row.get("shm_mapped"),
             row.get("shm_entries"),
             row.get("cpu_pct"), row["requests"], row["p50_ms"], row["p99_ms"], row["wrong"], row["failed"],
             row["unavailable_by_design"]] for row in series]
    text = table(["t s", "RSS MiB", "fds", "threads", "shm mapped", "/dev/shm new", "server cpu %", "requests",
                  "p50 ms", "p99 ms", "wrong", "failed", "by design"], rows)
    text += "\n" + table(["operation", "answers", "p50 ms", "p99 ms", "max ms"],
                         [[name, op["answers"], op["p50_ms"], op["p99_ms"], op["max_ms"]]
                          for name, op in summary["operations"].items()])
    loads = [e["end"] - e["start"] for e in events if e["action"] == "publish" and not e["error"]]
    text += (f"\nrequests {summary['requests']:,}, wrong {summary['wrong_answers']}, failed "
             f"{summary['failed_requests']}, unavailable by design {summary['unavailable_by_design']}; server cpu "
             f"{cell(summary['server_cpu_pct_mean'])}% of a core on average\n"
             f"actions: {_counts(summary['actions'])}"
             + (f"; a publish took {np.mean(loads):.2f} s on average, {max(loads):.2f} s at most" if loads else "")
             + f"\nchaos: {_counts(summary['chaos'])}\nversions that answered: {_counts(summary['versions'])}\n\n")
    for check in summary["criteria"]:
        text += f"{'PASS' if check['passed'] else 'FAIL'}  {check['name']}: {check['detail']}\n"
    return text + f"\n{'PASS' if summary['passed'] else 'FAIL'}\n"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {count:,}" for name, count in sorted(counts.items())) or "none"


def plot(series: list[dict[str, Any]], events: list[dict[str, Any]], warm: int, window_s: float, t0: float,
         toggled: str, path: Path) -> None:
    """RSS, descriptors, threads, shared memory, p50/p99 and errors against time; the end of the warm-up, the
    bar's ceiling for RSS and descriptors, the published versions and the toggled model's outages marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [row["t_end_s"] for row in series]
    fig, axes = plt.subplots(3, 2, figsize=(12, 10), sharex=True)
    panels = [("server RSS (MiB)", ["rss_mib"]), ("open descriptors", ["fds"]), ("threads", ["threads"]),
              ("shared memory", ["shm_mapped", "shm_entries"]), ("latency per window (ms)", ["p50_ms", "p99_ms"]),
              ("per window", ["failed", "wrong", "unavailable_by_design"])]
    for ax, (title, keys) in zip(axes.flat, panels, strict=True):
        for key in keys:
            ax.plot(t, [row.get(key) if row.get(key) is not None else np.nan for row in series], marker=".",
                    label=key)
        ax.axvline(warm * window_s, color="grey", linestyle="--", linewidth=1)
        if keys[0] in ("rss_mib", "fds") and series[warm - 1].get(keys[0]) is not None:  # the bar's ceiling
            ax.axhline(series[warm - 1][keys[0]] * (1 + FLAT_WITHIN), color="tab:red", linestyle=":", linewidth=1)
        for event in events:
            if event["action"] == "publish":
                ax.axvline(event["end_s"], color="tab:green", alpha=0.15, linewidth=1)
        for start, end in outages(events, toggled):
            ax.axvspan(start - t0, min(end - t0, t[-1]), color="tab:orange", alpha=0.1)
        ax.set_title(title)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("seconds (dashed: end of warm-up; dotted: +5%; green: a new version; orange: unloaded)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
