"""``kiln ab report MODEL``: how a model's versions compare under A/B routing and shadow traffic.

The report reads the model's routing status (``GET /v2/repository/models/{name}/kiln/routing``) and statistics
from a running ``kiln serve``: per version, the routed and explicit request counts, the share of routed traffic,
the request counts of the statistics extension, recent latency percentiles, and what shadow traffic found. With
the capture store's folder it also checks agreement on captured samples (kiln/ab/agreement.py).
"""

from __future__ import annotations

import urllib.parse
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

from kiln.ab.agreement import capture_agreement
from kiln.errors import UnavailableError
from kiln.server.shadow import DEFAULT_ATOL, DEFAULT_RTOL
from kiln.v2.client import HttpClient, ServerUnreachableError


def build_report(url: str, model: str, capture_dir: Path | None, atol: float = DEFAULT_ATOL,
                 rtol: float = DEFAULT_RTOL) -> dict[str, Any]:
    routing = fetch_routing(url, model)
    stats = fetch_statistics(url, model)
    requests = {s["version"]: s["inference_stats"] for s in stats.get("model_stats", [])}
    for version in routing["versions"]:
        inference = requests.get(version["version"], {})
        version["requests_success"] = inference.get("success", {}).get("count", 0)
        version["requests_failed"] = inference.get("fail", {}).get("count", 0)
    report: dict[str, Any] = {"model": model, "url": url, "routing": routing}
    if capture_dir is not None:
        report["captures"] = asdict(capture_agreement(capture_dir, model, atol, rtol))
    return report


# -- the server's answers: one request each ---------------------------------------------------------------------


def fetch_routing(url: str, model: str) -> Any:
    """The model's A/B routing status: ``GET /v2/repository/models/{model}/kiln/routing`` (a kiln extension)."""
    return _get(url, f"/v2/repository/models/{urllib.parse.quote(model, safe='')}/kiln/routing")


def fetch_statistics(url: str, model: str) -> Any:
    """The model's statistics, every version: ``GET /v2/models/{model}/stats``."""
    return _get(url, f"/v2/models/{urllib.parse.quote(model, safe='')}/stats")


def _get(url: str, path: str) -> Any:
    with HttpClient(url, timeout_s=10) as client:
        try:
            return client.get(path)
        except ServerUnreachableError as exc:
            raise _unreachable(client.url, exc) from None


def _unreachable(url: str, exc: ServerUnreachableError) -> UnavailableError:
    return UnavailableError(f"ab report: cannot reach {url}/: {exc.message}; is `kiln serve` running there "
                            f"(-u host:port)?")


# -- printing ----------------------------------------------------------------------------------------------------


def print_report(report: dict[str, Any], out: TextIO) -> None:
    routing = report["routing"]
    source = {"config": "from the model config", "runtime": "set at run time",
              "none": "no weights: the newest ready version serves"}.get(routing["source"], routing["source"])
    out.write(f"model '{report['model']}' at {report['url']}: routing {source}; sticky key parameter "
              f"'{routing['key_parameter']}'\n\n")
    header = ("version", "ready", "weight", "share", "routed", "explicit", "success", "failed", "p50 ms", "p90 ms",
              "p99 ms")
    rows = [header] + [(v["version"], "yes" if v["ready"] else "no", f"{v['weight']:g}", f"{v['share']:.1%}",
                        str(v["routed"]), str(v["explicit"]), str(v["requests_success"]),
                        str(v["requests_failed"]), _ms(v["p50_ms"]), _ms(v["p90_ms"]), _ms(v["p99_ms"]))
                       for v in routing["versions"]]
    _table(rows, out)
    out.write("\n(routed/explicit: answers since the routing settings were made; success/failed: the statistics "
              "extension, shadow requests included; percentiles over recent answers)\n")
    _print_shadow(routing.get("shadow"), out)
    if "captures" in report:
        _print_captures(report["captures"], out)


def _print_shadow(shadow: dict[str, Any] | None, out: TextIO) -> None:
    if shadow is None:
        out.write("\nshadow traffic: off\n")
        return
    out.write(f"\nshadow traffic to version {shadow['version']} (fraction {shadow['fraction']:g}, atol "
              f"{shadow['atol']:g}, rtol {shadow['rtol']:g}): {shadow['mirrored']} mirrored, "
              f"{shadow['agreed']} agreed ({_share(shadow['agreed'], shadow['mirrored'])}), {shadow['disagreed']} "
              f"disagreed, {shadow['errors']} errors, {shadow['skipped']} skipped; max abs difference "
              f"{shadow['max_abs_diff']:.3g}")
    if shadow["top1_rows"]:
        out.write(f"; top-1 agreement {_share(shadow['top1_agreed'], shadow['top1_rows'])} of "
                  f"{shadow['top1_rows']} rows")
    out.write("\n")


def _print_captures(captures: dict[str, Any], out: TextIO) -> None:
    counts = ", ".join(f"version {v}: {n}" for v, n in captures["samples"].items()) or "none"
    out.write(f"\ncaptured samples: {counts}\n")
    for version, agreement in captures["against_reference"].items():
        out.write(f"  version {version} against the reference answers: {_agreement(agreement)}\n")
    for pair, agreement in captures["between_versions"].items():
        a, b = pair.split(":")
        out.write(f"  version {a} against version {b} on the same inputs: {_agreement(agreement)}\n")
    if captures["note"]:
        out.write(f"  {captures['note']}\n")


def _agreement(a: dict[str, Any]) -> str:
    text = (f"{a['agreed']} of {a['compared']} samples agree ({_share(a['agreed'], a['compared'])}), max abs "
            f"difference {a['max_abs_diff']:.3g}")
    if a["top1_rows"]:
        text += f", top-1 agreement {_share(a['top1_agreed'], a['top1_rows'])} of {a['top1_rows']} rows"
    return text


def _table(rows: list[tuple[str, ...]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)).rstrip() + "\n")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "-"
