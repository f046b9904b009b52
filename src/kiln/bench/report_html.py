"""One self-contained HTML page for a ``kiln bench compare`` result: inline CSS, plots as base64 data URIs, no
scripts and no external URLs, so the file can be mailed or archived as it is."""

from __future__ import annotations

import base64
import html
from typing import Any

from kiln.bench.report import (
    BATCH_NOTE,
    BATCH_TITLE,
    CPU_NOTE,
    CPU_TITLE,
    TOGETHER_NOTE,
    TOGETHER_TITLE,
    Table,
    batch_table,
    comparison_table,
    cpu_table,
    machine_line,
    memory_table,
    serve_flags,
    together_table,
)

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1150px; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #bbb; padding: 4px 10px; }
th { background: #eef; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
img { display: block; margin: 1em 0; max-width: 100%; border: 1px solid #ddd; }
code { background: #f4f4f4; padding: 2px 4px; }
"""


def _table(table: Table) -> str:
    head = "".join(f"<th>{html.escape(cell)}</th>" for cell in table.header)
    body = []
    for row in table.rows:
        cells = "".join(f'<td class="num">{html.escape(c)}</td>' if i >= table.numeric else f"<td>{html.escape(c)}</td>"
                        for i, c in enumerate(row))
        body.append(f"<tr>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _image(name: str, data: bytes) -> str:
    encoded = base64.b64encode(data).decode("ascii")
    return f'<img alt="{html.escape(name)}" src="data:image/png;base64,{encoded}">'


def render_html(doc: dict[str, Any], images: dict[str, bytes], command: str | None = None) -> str:
    model = html.escape(doc["model"])
    protocol = html.escape(str(doc.get("protocol", "http")))
    notes = "".join(f"<li>{html.escape(note)}</li>" for note in doc.get("notes") or [])
    flags = serve_flags(doc)
    served_with = f" <code>kiln serve</code> ran with <code>{html.escape(flags)}</code>." if flags else ""
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>kiln bench compare: {model}</title><style>{_STYLE}</style></head><body>",
        f"<h1>kiln bench compare: {model}</h1>",
        f"<p><b>Machine:</b> {html.escape(machine_line(doc.get('machine', {})))}</p>",
        f"<p>Served scenarios are measured over {protocol}; each peer model receives the same concurrency as the "
        f"measured model.{served_with}</p>",
        f"<p><b>Command:</b> <code>{html.escape(command)}</code></p>" if command else "",
        "<h2>Throughput (requests/s, ratio to direct) and p99 latency by concurrency</h2>",
        _table(comparison_table(doc)),
        *_together(doc),
        "<h2>Memory (RSS)</h2>", _table(memory_table(doc)),
        "<p>Served memory is the batching variant with the higher peak.</p>",
        *_cpu(doc),
        *_batches(doc),
        f"<h2>Notes</h2><ul>{notes}</ul>" if notes else "",
        "<h2>Plots</h2>", *(_image(name, data) for name, data in images.items()),
        "</body></html>",
    ]
    return "\n".join(part for part in parts if part) + "\n"


def _batches(doc: dict[str, Any]) -> list[str]:
    table = batch_table(doc)
    if table is None:
        return []
    return [f"<h2>{html.escape(BATCH_TITLE)}</h2>", f"<p>{html.escape(BATCH_NOTE)}</p>", _table(table)]


def _cpu(doc: dict[str, Any]) -> list[str]:
    table = cpu_table(doc)
    if table is None:
        return []
    return [f"<h2>{html.escape(CPU_TITLE)}</h2>", f"<p>{html.escape(CPU_NOTE)}</p>", _table(table)]


def _together(doc: dict[str, Any]) -> list[str]:
    table = together_table(doc)
    if table is None:
        return []
    return [f"<h2>{html.escape(TOGETHER_TITLE)}</h2>", f"<p>{html.escape(TOGETHER_NOTE)}</p>", _table(table)]
