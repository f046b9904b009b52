"""``kiln ab report MODEL``: how a model's versions compare under A/B routing and shadow traffic.

It reads the model's routing status (``GET /v2/repository/models/{name}/kiln/routing``) and statistics from a
running ``kiln serve`` and prints, per version, the routed and explicit request counts, the share of routed
traffic, the request counts of the statistics extension, recent latency percentiles, and what shadow traffic found.
With ``--capture-dir`` (kiln serve's capture store) it also checks agreement on captured samples: each version's
answers (``local/...``) against the reference answers stored with them (``cloud/...``, the store's labels), and
versions against each other on inputs captured for more than one version.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt

from kiln.errors import InvalidArgumentError, NotFoundError, UnavailableError
from kiln.server.capture import live_samples
from kiln.server.shadow import DEFAULT_ATOL, DEFAULT_RTOL, compare_arrays

Arrays = dict[str, npt.NDArray[Any]]


def add_ab_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="ab_command", required=True)
    report = commands.add_parser("report", help="per-version counts, latency percentiles and agreement")
    report.add_argument("model", help="the model to report on")
    report.add_argument("-u", "--url", default="localhost:8000", help="the server's HTTP address (default "
                                                                      "localhost:8000)")
    report.add_argument("--capture-dir", type=Path, default=None, metavar="DIR",
                        help="kiln serve's --capture-dir: also compare the versions' captured answers")
    report.add_argument("--atol", type=float, default=DEFAULT_ATOL, help="absolute tolerance for captured answers")
    report.add_argument("--rtol", type=float, default=DEFAULT_RTOL, help="relative tolerance for captured answers")
    report.add_argument("--json", action="store_true", help="print the report as JSON")


def run_ab(args: argparse.Namespace) -> int:
    report = build_report(args.url, args.model, args.capture_dir, args.atol, args.rtol)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_report(report, sys.stdout)
    return 0


def build_report(url: str, model: str, capture_dir: Path | None, atol: float = DEFAULT_ATOL,
                 rtol: float = DEFAULT_RTOL) -> dict[str, Any]:
    base = url if "://" in url else f"http://{url}"
    quoted = urllib.parse.quote(model, safe="")
    routing = _get(f"{base}/v2/repository/models/{quoted}/kiln/routing")
    stats = _get(f"{base}/v2/models/{quoted}/stats")
    requests = {s["version"]: s["inference_stats"] for s in stats.get("model_stats", [])}
    for version in routing["versions"]:
        inference = requests.get(version["version"], {})
        version["requests_success"] = inference.get("success", {}).get("count", 0)
        version["requests_failed"] = inference.get("fail", {}).get("count", 0)
    report: dict[str, Any] = {"model": model, "url": url, "routing": routing}
    if capture_dir is not None:
        report["captures"] = asdict(capture_agreement(capture_dir, model, atol, rtol))
    return report


def _get(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        message = _error_message(exc)
        if exc.code == 404:
            raise NotFoundError(f"ab report: {message}") from None
        raise UnavailableError(f"ab report: GET {url} answered {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise UnavailableError(f"ab report: cannot reach {url}: {exc}; is `kiln serve` running there "
                               f"(-u host:port)?") from None


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read()).get("error", exc.reason))
    except (ValueError, AttributeError):
        return str(exc.reason)


# -- captured samples --------------------------------------------------------------------------------------------


@dataclass
class Agreement:
    """Samples compared, how many agreed within tolerance, and top-1 agreement on class-score outputs."""

    compared: int = 0
    agreed: int = 0
    top1_rows: int = 0
    top1_agreed: int = 0
    max_abs_diff: float = 0.0

    def add(self, reference: Arrays, other: Arrays, atol: float, rtol: float) -> None:
        result = compare_arrays(reference, other, atol, rtol)
        self.compared += 1
        self.agreed += int(result.agreed)
        self.top1_rows += result.top1_rows
        self.top1_agreed += result.top1_agreed
        self.max_abs_diff = max(self.max_abs_diff, result.max_abs_diff)


@dataclass
class CaptureAgreement:
    samples: dict[str, int]  # per version
    against_reference: dict[str, Agreement]  # per version: its local answers against the stored cloud answers
    between_versions: dict[str, Agreement]  # "a:b": the two versions' answers on the same captured inputs
    note: str = ""


def capture_agreement(capture_dir: Path, model: str, atol: float = DEFAULT_ATOL,
                      rtol: float = DEFAULT_RTOL) -> CaptureAgreement:
    folder = Path(capture_dir) / model
    if not folder.is_dir():
        raise NotFoundError(f"ab report: no captured samples of model '{model}' under '{capture_dir}'")
    if atol < 0 or rtol < 0:
        raise InvalidArgumentError(f"ab report: tolerances must be >= 0, got atol={atol} rtol={rtol}")
    versions = sorted((p.name for p in folder.iterdir() if p.is_dir() and p.name.isdigit()), key=int)
    result = CaptureAgreement({}, {}, {})
    by_input: dict[str, dict[str, Arrays]] = {}  # input digest -> version -> its answers
    for version in versions:
        samples = live_samples(folder / version)
        result.samples[version] = len(samples)
        for entry in samples:
            arrays = _load(folder / version / entry["file"])
            local, cloud = _part(arrays, "local"), _part(arrays, "cloud")
            if local and cloud and set(local) & set(cloud):
                shared = sorted(set(local) & set(cloud))
                result.against_reference.setdefault(version, Agreement()).add(
                    {n: cloud[n] for n in shared}, {n: local[n] for n in shared}, atol, rtol)
            if local:
                by_input.setdefault(_digest(_part(arrays, "input")), {}).setdefault(version, local)
    for answers in by_input.values():
        for a, b in itertools.combinations(sorted(answers, key=int), 2):
            result.between_versions.setdefault(f"{a}:{b}", Agreement()).add(answers[a], answers[b], atol, rtol)
    if not result.against_reference and not result.between_versions:
        result.note = (f"nothing to compare: the captured samples of model '{model}' carry no reference answers "
                       f"(cloud/...) next to a version's answers (local/...), and no input was captured for more "
                       f"than one version")
    return result


def _load(path: Path) -> Arrays:
    with np.load(path, allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


def _part(arrays: Arrays, kind: str) -> Arrays:
    prefix = f"{kind}/"
    return {name[len(prefix):]: array for name, array in arrays.items() if name.startswith(prefix)}


def _digest(inputs: Arrays) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(inputs):
        array = np.ascontiguousarray(inputs[name])
        digest.update(f"{name}\x00{array.dtype.str}\x00{array.shape}\x00".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


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
