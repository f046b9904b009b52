"""One change, measured: `kiln serve` from two src/ trees in turn (before, after), `kiln bench` against each.

Rounds alternate the two servers so that drift of a shared machine falls on both; each row is one round, and the
last line gives the median ratio after / before per model.

    git worktree add /tmp/before HEAD~1
    python benchmarks/before_after.py --before /tmp/before/src --models simple,mlp \
        --output benchmarks/results/before_after-<what>-<date>.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import SRC, describe, header, pythonpath, str_list, table, write_outputs

from kiln.bench import BenchOptions, run
from kiln.demo import build_demo_repository
from kiln.serve_process import kiln_serve


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the src/ folder of the code before the change")
    parser.add_argument("--after", type=Path, default=SRC, help="the src/ folder after it (default: this checkout)")
    parser.add_argument("--models", default="simple,mlp", help="demo models to measure")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="measurement window of kiln bench")
    parser.add_argument("--tensor-format", choices=["binary", "json"], default="binary")
    parser.add_argument("--output", type=Path, default=None, help="JSON results (a .txt table goes beside it)")
    args = parser.parse_args(argv)

    rows: list[dict[str, Any]] = []
    models = str_list(args.models)
    with tempfile.TemporaryDirectory(prefix="kiln-before-after-") as tmp:
        repo = Path(tmp) / "repo"
        build_demo_repository(repo)
        for model in models:
            for round_ in range(1, args.rounds + 1):
                rates = {}
                for label, src in (("before", args.before), ("after", args.after)):
                    with contextlib.ExitStack() as stack:
                        with pythonpath(src):
                            server = stack.enter_context(kiln_serve([repo], "--model-control-mode", "explicit",
                                                                    "--load-model", model))
                        rates[label] = _bench(server.http_url, model, args)
                rows.append({"model": model, "round": round_, **rates, "ratio": rates["after"] / rates["before"]})
                print(f"{model} round {round_}: before {rates['before']:,.0f}, after {rates['after']:,.0f}",
                      file=sys.stderr)
    info = describe(f"Before and after: kiln bench at c={args.concurrency}, {args.tensor_format} tensors",
                    before=str(args.before), after=str(args.after))
    text = header(info) + "\n" + table(["model", "round", "before req/s", "after req/s", "after / before"],
                                       [[r["model"], r["round"], r["before"], r["after"], f"{r['ratio']:.2f}"]
                                        for r in rows], numeric_from=1)
    for model in models:
        ratios = [r["ratio"] for r in rows if r["model"] == model]
        text += f"{model}: median after / before {statistics.median(ratios):.2f} over {len(ratios)} rounds\n"
    print(text)
    write_outputs(args.output, {"info": info, "rows": rows}, text)
    return 0


def _bench(url: str, model: str, args: argparse.Namespace) -> float:
    """kiln bench against the server at ``url``: windows of ``--seconds``, at most four."""
    result = run(BenchOptions(model=model, target="http", url=url, concurrency=(args.concurrency,),
                              measurement_interval_ms=int(args.seconds * 1000), max_trials=4,
                              input_tensor_format=args.tensor_format, output_tensor_format=args.tensor_format))
    return result.results[0].throughput_infer_per_s


if __name__ == "__main__":
    sys.exit(main())
