"""One change, measured: `kiln serve` from two src/ trees in turn (before, after), `kiln bench` against each.

Rounds alternate the two servers so that drift of a shared machine falls on both; each row is one round, and the
last line gives the median ratio after / before per model.

    git worktree add /tmp/before HEAD~1
    python benchmarks/before_after.py --before /tmp/before/src --models simple,mlp \
        --output benchmarks/results/before_after-<what>-<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command_line, format_table, header_lines, machine_info, write_json

SRC = Path(__file__).resolve().parents[1] / "src"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the src/ folder of the code before the change")
    parser.add_argument("--after", type=Path, default=SRC, help="the src/ folder after it (default: this checkout)")
    parser.add_argument("--models", default="simple,mlp", help="demo models to measure")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="measurement window of kiln bench")
    parser.add_argument("--tensor-format", choices=["binary", "json"], default="binary")
    parser.add_argument("--output", type=Path, default=None, help="JSON results (a .txt table goes beside it)")
    args = parser.parse_args()
    sys.path.insert(0, str(SRC))
    from kiln.demo import build_demo_repository
    from kiln.testing.serve import kiln_serve

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-before-after-") as tmp:
        repo = Path(tmp) / "repo"
        build_demo_repository(repo)
        for model in args.models.split(","):
            for round_ in range(1, args.rounds + 1):
                rates = {}
                for label, src in (("before", args.before), ("after", args.after)):
                    with _server_env(src), kiln_serve([repo], "--model-control-mode", "explicit",
                                                      "--load-model", model) as server:
                        rates[label] = _bench(server.http_url, model, args, Path(tmp))
                rows.append({"model": model, "round": round_, **rates, "ratio": rates["after"] / rates["before"]})
                print(f"{model} round {round_}: before {rates['before']:,.0f}, after {rates['after']:,.0f}",
                      file=sys.stderr)
    info = {**machine_info(), "command": command_line()}
    lines = header_lines(f"Before and after: kiln bench at c={args.concurrency}, {args.tensor_format} tensors", info)
    lines.append(f"before: {args.before}; after: {args.after}")
    lines += ["", *format_table(["model", "round", "before req/s", "after req/s", "after / before"],
                                [[r["model"], r["round"], f"{r['before']:,.0f}", f"{r['after']:,.0f}",
                                  f"{r['ratio']:.2f}"] for r in rows])]
    for model in args.models.split(","):
        ratios = [r["ratio"] for r in rows if r["model"] == model]
        lines.append(f"{model}: median after / before {statistics.median(ratios):.2f} over {len(ratios)} rounds")
    print("\n".join(lines))
    if args.output is not None:
        write_json(args.output, {"info": info, "rows": rows})
        args.output.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    return 0


class _server_env:
    """PYTHONPATH for the server process kiln_serve starts (it inherits this process's environment)."""

    def __init__(self, src: Path) -> None:
        self._src = str(src.resolve())
        self._saved: str | None = None

    def __enter__(self) -> None:
        self._saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = self._src

    def __exit__(self, *exc: object) -> None:
        if self._saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = self._saved


def _bench(url: str, model: str, args: argparse.Namespace, tmp: Path) -> float:
    out = tmp / "bench.json"
    command = [sys.executable, "-m", "kiln.cli", "bench", "-m", model, "-u", url, "--concurrency",
               str(args.concurrency), "-p", str(int(args.seconds * 1000)), "-r", "4", "--quiet",
               "--input-tensor-format", args.tensor_format, "--output-tensor-format", args.tensor_format,
               "--json", str(out)]
    subprocess.run(command, env={**os.environ, "PYTHONPATH": str(SRC)}, check=True, capture_output=True)
    return float(json.loads(out.read_text())["results"][0]["throughput_infer_per_s"])


if __name__ == "__main__":
    sys.exit(main())
