"""Edge figures on the demo ``mlp``: local vs forwarded latency, and the forwarded fraction vs the threshold.

A real ``kiln serve`` (the cloud) runs the demo repository on free ports; an :class:`kiln.edge.EdgeRunner` in
``cloud-fallback`` mode runs the same ``mlp`` in this process. Inputs are standard-normal rows (seeded), batch 1.

1. **Latency.** Two runners on the same model: one whose policy forwards nothing (every answer is local) and one
   whose policy forwards everything (``max_prob_below`` above 1: every answer comes from the cloud over HTTP). The
   two are timed alternately, request by request, so drift on the machine hits both alike. Reported: median, p99
   and mean of ``EdgeRunner.infer`` wall time, and the direct ``engine.infer`` underneath for reference.
2. **Forwarded fraction vs threshold.** For a fixed sample set, the local outputs are computed once and the
   policy decision (:func:`kiln.edge.policy.decide`) is taken for each ``max_prob_below`` threshold. For the
   thresholds in ``--check``, a runner with that policy answers every sample and its counters (flagged requests,
   cloud answers) must equal the computed count; a mismatch fails the script.

    python benchmarks/edge_figures.py [--requests 2000] [--samples 2000] [--output results.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _common import Array, describe, header, table, write_outputs

from kiln.demo import build_demo_repository
from kiln.serve_process import kiln_serve

MODEL = "mlp"
FEATURES = 64


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="timed requests per path (default 2000)")
    parser.add_argument("--warmup", type=int, default=200, help="untimed requests per path first (default 200)")
    parser.add_argument("--samples", type=int, default=2000, help="samples of the threshold sweep (default 2000)")
    parser.add_argument("--thresholds", default="0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9",
                        help="max_prob_below values of the sweep")
    parser.add_argument("--check", default="0.3,0.5,0.7",
                        help="thresholds whose fraction is also measured through a runner's counters")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="write all results as JSON here")
    args = parser.parse_args(argv)

    info = describe("kiln edge figures (demo mlp, edge in-process, cloud = kiln serve on loopback)")
    print(header(info), flush=True)
    with tempfile.TemporaryDirectory(prefix="kiln-edge-fig-") as tmp_name:
        tmp = Path(tmp_name)
        repo = tmp / "repo"
        build_demo_repository(repo)
        with kiln_serve([repo], log_path=tmp / "serve.log") as cloud:
            latency = _latency(repo / MODEL, cloud.http_url, args)
            sweep = _sweep(repo / MODEL, cloud.http_url, args)
    text = header(info) + _report(latency, sweep)
    print(text[len(header(info)):])
    write_outputs(args.output, {"machine": info, "args": vars(args), "latency": latency, "sweep": sweep}, text)
    return 0 if all(row["checked"] in (None, True) for row in sweep["rows"]) else 1


def _inputs(rng: np.random.Generator, n: int) -> list[dict[str, Array]]:
    return [{"INPUT0": rng.standard_normal((1, FEATURES), dtype=np.float32)} for _ in range(n)]


def _latency(model: Path, cloud: str, args: argparse.Namespace) -> dict[str, Any]:
    from kiln.edge import EdgeRunner, Policy
    from kiln.edge.runner import EdgeResult

    samples = _inputs(np.random.default_rng(args.seed), args.requests)
    timings: dict[str, list[float]] = {"direct": [], "local": [], "forwarded": []}
    with EdgeRunner(model, cloud, Policy()) as local, EdgeRunner(model, cloud, Policy(max_prob_below=1.01)) as fwd:
        paths = {"direct": local.engine.infer, "local": local.infer, "forwarded": fwd.infer}
        for _ in range(args.warmup):
            for call in paths.values():
                call(samples[0])
        sources: dict[str, set[str]] = {"local": set(), "forwarded": set()}
        for sample in samples:
            for name, call in paths.items():
                t0 = time.perf_counter()
                result = call(sample)
                timings[name].append(time.perf_counter() - t0)
                if isinstance(result, EdgeResult):
                    sources[name].add(result.source)
    if sources != {"local": {"local"}, "forwarded": {"cloud"}}:
        raise RuntimeError(f"unexpected answer sources: {sources}")
    return {name: _summary(values) for name, values in timings.items()}


def _summary(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in seconds)
    return {"n": len(ms), "p50_ms": statistics.median(ms), "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
            "mean_ms": statistics.fmean(ms)}


def _sweep(model: Path, cloud: str, args: argparse.Namespace) -> dict[str, Any]:
    from kiln.edge import EdgeRunner, Policy
    from kiln.edge.policy import decide, probabilities

    thresholds = [float(t) for t in args.thresholds.split(",")]
    checks = {float(t) for t in args.check.split(",") if t}
    samples = _inputs(np.random.default_rng(args.seed + 1), args.samples)
    with EdgeRunner(model, cloud, Policy()) as runner:
        outputs = [runner.engine.infer(sample) for sample in samples]
    top = np.array([probabilities(out["OUTPUT0"]).max() for out in outputs])
    rows = []
    for threshold in thresholds:
        policy = Policy(max_prob_below=threshold)
        computed = sum(decide(policy, sample, out).forward for sample, out in zip(samples, outputs, strict=True))
        row: dict[str, Any] = {"threshold": threshold, "forwarded": computed, "fraction": computed / len(samples),
                               "runner": None, "checked": None}
        if threshold in checks:
            with EdgeRunner(model, cloud, policy) as checker:
                for sample in samples:
                    checker.infer(sample)
                stats = checker.stats.snapshot()
            row["runner"] = stats
            row["checked"] = stats["flagged"] == computed and stats["cloud_answers"] == computed
        rows.append(row)
    quantiles = {f"q{int(q * 100)}": float(np.quantile(top, q)) for q in (0.01, 0.1, 0.5, 0.9, 0.99)}
    return {"samples": len(samples), "max_probability": quantiles, "rows": rows}


def _report(latency: dict[str, Any], sweep: dict[str, Any]) -> str:
    what = {"direct": "engine.infer (no policy)", "local": "edge, answered locally",
            "forwarded": "edge, forwarded (cloud answer over HTTP)"}
    parts = ["\n## Latency, batch 1 (EdgeRunner.infer wall time; direct = the engine alone)\n",
             table(["path", "requests", "p50 ms", "p99 ms", "mean ms"],
                   [[what[name], s["n"], s["p50_ms"], s["p99_ms"], s["mean_ms"]] for name, s in latency.items()]),
             f"## Forwarded fraction vs max_prob_below ({sweep['samples']} samples, batch 1)\n",
             "max probability of the local answer: "
             + ", ".join(f"{k} {v:.3f}" for k, v in sweep["max_probability"].items()) + "\n"]
    rows = []
    for row in sweep["rows"]:
        check = "-" if row["checked"] is None else (
            f"{'ok' if row['checked'] else 'MISMATCH'} (flagged {row['runner']['flagged']}, "
            f"cloud answers {row['runner']['cloud_answers']})")
        rows.append([row["threshold"], row["forwarded"], f"{row['fraction']:.3f}", check])
    parts.append(table(["max_prob_below", "forwarded", "fraction", "runner's counters"], rows))
    return "\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
