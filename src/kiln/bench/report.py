"""The report of a ``kiln bench compare`` result: a Markdown table laid out like the seed article's (a row per
scenario, throughput at each concurrency with its ratio to direct, p99, memory), PNG plots and one HTML page.

Plots use matplotlib's object API on an Agg canvas (no pyplot state, no display); matplotlib is imported only
when plots are drawn and comes with the ``bench`` extra.
"""

from __future__ import annotations

import io
import json
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import UnavailableError

PLOTS = ("throughput.png", "p99.png", "memory.png")
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")
_MEMORY_LABELS = {"direct": "direct process", "served": "server, one model", "served_with_others": "server, {n} models"}


def scenario_label(scenario: dict[str, Any]) -> str:
    name, models = scenario["name"], scenario["models_loaded"]
    if name == "direct":
        return "direct"
    base = "served, 1 model" if name == "served" else f"served, {models} models"
    label = f"{base}, dynamic batching" if scenario["batching"] else base
    generators = {row.get("load_generator", "kiln") for row in scenario["results"]}
    return f"{label} (perf_analyzer)" if "perf_analyzer" in generators else label


@dataclass(frozen=True)
class Table:
    header: list[str]
    rows: list[list[str]]
    numeric: int  # columns from this index on are numbers (right-aligned)


def _level(scenario: dict[str, Any], concurrency: int) -> dict[str, Any] | None:
    """The scenario's result at ``concurrency``; a level that counted no request is shown as missing, not as 0."""
    row = next((r for r in scenario["results"] if r["concurrency"] == concurrency), None)
    return None if row is None or row.get("requests", 1) == 0 else row


def _number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def comparison_table(doc: dict[str, Any]) -> Table:
    """Rows: scenarios; columns: throughput (requests/s, ratio to direct) and p99 (ms) at each concurrency, then
    RSS idle and peak (MiB)."""
    levels: list[int] = doc["concurrency"]
    direct = next((s for s in doc["scenarios"] if s["name"] == "direct"), None)
    header = ["scenario", *(f"c={c} req/s (vs direct)" for c in levels), *(f"c={c} p99 ms" for c in levels),
              "RSS idle MiB", "RSS peak MiB"]
    rows = []
    for scenario in doc["scenarios"]:
        throughput, p99 = [], []
        for c in levels:
            row, base = _level(scenario, c), _level(direct, c) if direct is not None else None
            value = row["throughput_infer_per_s"] if row is not None else None
            ratio = ""
            if value is not None and base is not None and base["throughput_infer_per_s"] > 0:
                ratio = f" ({value / base['throughput_infer_per_s']:.2f}x)"
            throughput.append(_number(value, 1 if value is not None and value < 100 else 0) + ratio)
            p99.append(_number(row["latency_ms"]["p99"] if row is not None else None, 2))
        memory = scenario.get("memory_mb", {})
        rows.append([scenario_label(scenario), *throughput, *p99, _number(memory.get("idle"), 1),
                     _number(memory.get("peak"), 1)])
    return Table(header, rows, numeric=1)


TOGETHER_TITLE = "All models together (requests/s the server answered, ratio to one model alone)"
TOGETHER_NOTE = ("From the server's statistics over the windows kept at each level of the measured model, peers "
                 "included; the ratio is to the one-model scenario with the same batching.")


def together_table(doc: dict[str, Any]) -> Table | None:
    """Served scenarios: every model's requests/s summed at each level, as the server counted them over the
    windows the measured model's level kept; None for a comparison recorded without those counts."""
    levels: list[int] = doc["concurrency"]
    served = [s for s in doc["scenarios"] if s["name"] != "direct"]
    if not any(_together(s, c) is not None for s in served for c in levels):
        return None
    rows = []
    for scenario in served:
        alone = next((s for s in served if s["name"] == "served" and s["batching"] == scenario["batching"]), None)
        cells = []
        for c in levels:
            total, base = _together(scenario, c), _together(alone, c) if alone is not None else None
            ratio = f" ({total / base:.2f}x)" if total is not None and base else ""
            cells.append(_number(total, 1 if total is not None and total < 100 else 0) + ratio)
        rows.append([scenario_label(scenario), *cells])
    return Table(["scenario", *(f"c={c} req/s (vs 1 model)" for c in levels)], rows, numeric=1)


def _together(scenario: dict[str, Any], concurrency: int) -> float | None:
    row = _level(scenario, concurrency)
    rates = row.get("server_models_per_s") if row is not None else None
    return sum(rates.values()) if rates else None


CPU_TITLE = ("CPU (cores used while each level ran: process / its main thread / its busiest thread / its children "
             "(the busiest child), machine idle)")
CPU_NOTE = ("The process under test is the server for served scenarios (its children: the frontend worker "
            "processes) and the measuring process for direct. The main thread runs the event loop: near 1.00 it "
            "cannot go faster, and an idle machine beside it means the cores are not the limit. The busiest thread "
            "may be another one (on a GPU host, the thread that waits for the device).")


def cpu_table(doc: dict[str, Any]) -> Table | None:
    """Where the CPU went at each level, per scenario; None when no level measured it (no psutil, older files)."""
    return _per_level_table(doc, _cpu_cell)


def _per_level_table(doc: dict[str, Any], cell: Callable[[dict[str, Any] | None], str]) -> Table | None:
    """One cell per scenario and level; scenarios with nothing to show ("-" everywhere) are left out, and the
    table is None when none is left."""
    levels: list[int] = doc["concurrency"]
    rows = []
    for scenario in doc["scenarios"]:
        cells = [cell(_level(scenario, c)) for c in levels]
        if any(text != "-" for text in cells):
            rows.append([scenario_label(scenario), *cells])
    return Table(["scenario", *(f"c={c}" for c in levels)], rows, numeric=1) if rows else None


BATCH_TITLE = "Batches (rows per execution of the measured model, from the server's statistics)"
BATCH_NOTE = ("Over the windows kept at each level. Small batches under load mean the device ran more, smaller "
              "executions than the load allowed: each one costs the server a launch.")


def batch_table(doc: dict[str, Any]) -> Table | None:
    """The measured model's average batch per served scenario and level; None when no level has it (direct-only
    runs, older files)."""
    def cell(row: dict[str, Any] | None) -> str:
        value = ((row or {}).get("server_rows_per_execution") or {}).get(doc["model"])
        return "-" if value is None else f"{value:.1f}"

    return _per_level_table(doc, cell)


def _cpu_cell(row: dict[str, Any] | None) -> str:
    cpu = row.get("cpu") if row is not None else None
    if not cpu:
        return "-"
    main = cpu.get("main_thread")
    return (f"{cpu['process']:.2f} / {'-' if main is None else f'{main:.2f}'} / {cpu['busiest_thread']:.2f} / "
            f"{cpu['children']:.2f} "
            f"({cpu.get('busiest_child', 0.0):.2f}), {cpu['machine_idle_pct']:.0f}% idle")


def memory_keys(doc: dict[str, Any]) -> list[str]:
    """The memory figures present: RSS always, GPU memory when any deployment has it."""
    entries = doc["memory_mb"].values()
    has_gpu = any(entry.get("gpu_idle") is not None or entry.get("gpu_peak") is not None for entry in entries)
    return ["idle", "peak", *(["gpu_idle", "gpu_peak"] if has_gpu else [])]


def memory_label(key: str) -> str:
    return f"GPU {key[4:]} MiB" if key.startswith("gpu_") else f"RSS {key} MiB"


def memory_table(doc: dict[str, Any]) -> Table:
    """The seed article's memory table: deployment, idle, peak (MiB), then GPU memory where it was read."""
    keys = memory_keys(doc)
    rows = []
    for name, entry in doc["memory_mb"].items():
        label = _MEMORY_LABELS.get(name, name).format(n=entry.get("models", ""))
        if "batching" in entry:
            label += ", dynamic batching" if entry["batching"] else ", no batching"
        rows.append([label, *(_number(entry.get(key), 1) for key in keys)])
    return Table(["deployment", *(memory_label(key) for key in keys)], rows, numeric=1)


def markdown_table(table: Table) -> str:
    align = ["---" if i < table.numeric else "---:" for i in range(len(table.header))]
    lines = [table.header, align, *table.rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines) + "\n"


def machine_line(machine: dict[str, Any]) -> str:
    gpus = ", ".join(machine.get("gpus") or []) or "no GPU"
    return (f"{machine.get('cpu_model', 'unknown CPU')}, {machine.get('cpu_count', '?')} cores, "
            f"{machine.get('memory_total') or '? memory'}, {gpus}; {machine.get('os', '')}, Python "
            f"{machine.get('python', '?')}, kiln {machine.get('kiln', '?')}")


def serve_flags(doc: dict[str, Any]) -> str:
    """The flags a comparison gave its `kiln serve` processes (--serve-args), shell-quoted; '' for none."""
    return shlex.join((doc.get("settings") or {}).get("serve_args") or [])


def markdown(doc: dict[str, Any], command: str | None = None) -> str:
    protocol = doc.get("protocol", "http")
    flags = serve_flags(doc)
    served_with = f" `kiln serve` ran with `{flags}`." if flags else ""
    parts = [f"# kiln bench compare: {doc['model']}\n",
             f"Machine: {machine_line(doc.get('machine', {}))}  ",
             f"Served scenarios are measured over {protocol}; peers receive the same concurrency as the model."
             f"{served_with}",
             *([f"Command: `{command}`"] if command else []), "",
             "## Throughput (requests/s, ratio to direct) and p99 latency by concurrency\n",
             markdown_table(comparison_table(doc)),
             *_together_section(doc),
             "## Memory (RSS)\n",
             markdown_table(memory_table(doc)),
             "Served memory is the batching variant with the higher peak.\n",
             *_cpu_section(doc),
             *_batch_section(doc)]
    notes = doc.get("notes") or []
    if notes:
        parts += ["## Notes\n", *(f"- {note}" for note in notes), ""]
    return "\n".join(parts)


def _together_section(doc: dict[str, Any]) -> list[str]:
    table = together_table(doc)
    return [] if table is None else [f"## {TOGETHER_TITLE}\n", TOGETHER_NOTE + "\n", markdown_table(table)]


def _batch_section(doc: dict[str, Any]) -> list[str]:
    table = batch_table(doc)
    return [] if table is None else [f"## {BATCH_TITLE}\n", BATCH_NOTE + "\n", markdown_table(table)]


def _cpu_section(doc: dict[str, Any]) -> list[str]:
    table = cpu_table(doc)
    return [] if table is None else [f"## {CPU_TITLE}\n", CPU_NOTE + "\n", markdown_table(table)]


# -- plots --------------------------------------------------------------------------------------------------------


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UnavailableError("kiln bench compare draws its plots with matplotlib, which is not installed: "
                               "pip install 'kiln[bench]'") from None
    return Figure, FigureCanvasAgg


def _png(figure: Any, canvas_type: Any) -> bytes:
    canvas_type(figure)
    out = io.BytesIO()
    figure.savefig(out, format="png", dpi=100)
    return out.getvalue()


def line_plot(doc: dict[str, Any], metric: str, ylabel: str, title: str) -> bytes:
    """One line per scenario over the concurrency levels; ``metric`` reads a value from a result row."""
    figure_type, canvas_type = _matplotlib()
    figure = figure_type(figsize=(8, 4.5))
    axes = figure.add_subplot()
    for index, scenario in enumerate(doc["scenarios"]):
        points = [(r["concurrency"], _metric(r, metric)) for r in scenario["results"]]
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", linewidth=2,
                  color=COLORS[index % len(COLORS)], label=scenario_label(scenario),
                  linestyle="--" if scenario["batching"] else "-")
    axes.set_xlabel("concurrency (requests outstanding)")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.set_xticks(doc["concurrency"])
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    return _png(figure, canvas_type)


def _metric(row: dict[str, Any], metric: str) -> float:
    value: Any = row
    for key in metric.split("."):
        value = value[key]
    return float(value)


def memory_plot(doc: dict[str, Any]) -> bytes:
    """Idle and peak bars per deployment: RSS, and GPU memory where it was read."""
    figure_type, canvas_type = _matplotlib()
    table = memory_table(doc)
    figure = figure_type(figsize=(8, 4.5))
    axes = figure.add_subplot()
    positions = list(range(len(table.rows)))
    entries = list(doc["memory_mb"].values())
    keys = memory_keys(doc)
    width = 0.8 / len(keys)
    for index, key in enumerate(keys):
        values = [entry.get(key) or 0.0 for entry in entries]
        offset = (index - (len(keys) - 1) / 2) * width
        axes.bar([p + offset for p in positions], values, width=width, label=memory_label(key), color=COLORS[index])
    axes.set_xticks(positions, [row[0] for row in table.rows], fontsize="small")
    axes.set_ylabel("MiB")
    axes.set_title(f"Memory: {doc['model']}")
    axes.legend()
    axes.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    return _png(figure, canvas_type)


def plots(doc: dict[str, Any]) -> dict[str, bytes]:
    return {
        "throughput.png": line_plot(doc, "throughput_infer_per_s", "requests/s",
                                    f"Throughput vs concurrency: {doc['model']}"),
        "p99.png": line_plot(doc, "latency_ms.p99", "p99 latency (ms)", f"p99 latency vs concurrency: {doc['model']}"),
        "memory.png": memory_plot(doc),
    }


def write_report(doc: dict[str, Any], output: Path, command: Sequence[str] | None = None) -> dict[str, Path]:
    """Write compare.json, compare.md, the PNG plots and report.html into ``output``; return their paths."""
    from kiln.bench.report_html import render_html

    output.mkdir(parents=True, exist_ok=True)
    command_text = shlex.join(command) if command else None
    images = plots(doc)
    files = {"compare.json": json.dumps(doc, indent=2) + "\n", "compare.md": markdown(doc, command_text)}
    written: dict[str, Path] = {}
    for name, text in files.items():
        written[name] = output / name
        written[name].write_text(text, encoding="utf-8")
    for name, data in images.items():
        written[name] = output / name
        written[name].write_bytes(data)
    written["report.html"] = output / "report.html"
    written["report.html"].write_text(render_html(doc, images, command_text), encoding="utf-8")
    return written
