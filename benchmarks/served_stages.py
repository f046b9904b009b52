"""Where one request's time goes, stage by stage, between the client and the device, at concurrency 1.

Probes (_stage_probes.py) timestamp the functions an inference request passes through: the HTTP frontend in its
worker processes or in the server process, the link between them, the batcher, a CUDA-graph engine's staging,
replay and copies, and the moment the batcher's waiter thread saw the device finish. With one request at a time the
events of one request follow each other, so the gap from one event to the next is what that step took, whichever
process ran it. The printout gives each step's median over the most common sequence of events, the process it ended
in (worker, server, direct), and what lies outside the traced processes: the client reading the answer and writing
the next request, and the kernel moving the bytes (from the answer's write to the next request's first byte).

Scenarios: `kiln serve` over HTTP with each ``--http-workers`` count, driven by `kiln bench` at concurrency 1
(``--load-generator perf_analyzer`` for NVIDIA's client), and with ``--direct`` the same model through ``kiln.load``
in one process (`kiln bench --target direct`), so the served rows read against the direct one. Any model serves:
the launch, engine and device steps appear where the model launches its batches (a CUDA-graph build, the stand-in);
for others the report holds the frontend, link and server steps, the model's run between admission and its answers.

    python benchmarks/served_stages.py --model-repository REPO --model resnet50 --http-workers 4,1 --direct \\
        --load-generator perf_analyzer --output benchmarks/results/served_stages-<host>-<date>.json
    python benchmarks/served_stages.py --stand-in    # no GPU: served_ceiling.py's device stand-in
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import BENCH_DIR, describe, header, int_list, table, write_outputs
from scheduler_ceiling import BACKEND
from served_ceiling import CONFIG, MODEL

from kiln.serve_process import free_port, stop, wait_ready

SERVED_START = "LimitedHttpToolsProtocol.on_message_begin"
DIRECT_START = "LaunchRunner.submit"
TRACE_VARIABLE = "KILN_STAGE_TRACE"
SITECUSTOMIZE = "import os\nimport _stage_probes\n_stage_probes.install(os.environ['KILN_STAGE_TRACE'])\n"
WARM_UP_SHARE = 0.1  # the first tenth of the requests: buffers, graphs and caches still filling


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", type=Path, help="the repository `kiln serve` loads")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--stand-in", action="store_true",
                        help="serve served_ceiling.py's device stand-in (0.5 ms per batch) instead of a repository")
    parser.add_argument("--http-workers", default="4,1", help="`kiln serve --http-workers` counts, one row each")
    parser.add_argument("--direct", action="store_true", help="also the model through kiln.load (a repository)")
    parser.add_argument("--seconds", type=float, default=2.0, help="each measurement window of `kiln bench`")
    parser.add_argument("--load-generator", choices=("kiln", "perf_analyzer"), default="kiln")
    parser.add_argument("--output", type=Path, default=None, help="JSON results; a .txt beside it gets the table")
    args = parser.parse_args(argv)
    if args.stand_in == (args.model_repository is not None):
        parser.error("give --model-repository or --stand-in (one of them)")
    if args.direct and args.stand_in:
        parser.error("--direct needs --model-repository: the stand-in is registered in `kiln serve` alone")
    scenarios = []
    with tempfile.TemporaryDirectory(prefix="kiln-served-stages-") as tmp:
        work = Path(tmp)
        (work / "site").mkdir()
        (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        repo = args.model_repository or _stand_in_repo(work / "repo")
        for workers in int_list(args.http_workers):
            scenarios.append(_served(args, repo, workers, work))
            print(_scenario_text(scenarios[-1]), flush=True)
        if args.direct:
            scenarios.append(_direct(args, repo, work))
            print(_scenario_text(scenarios[-1]), flush=True)
    info = describe("kiln served stages: one request's time, step by step, at concurrency 1",
                    model="device stand-in (0.5 ms per batch)" if args.stand_in else args.model,
                    load=f"kiln bench at concurrency 1, load generator {args.load_generator}, "
                         f"windows of {args.seconds:g} s")
    text = header(info) + "\n" + "\n".join(_scenario_text(s) for s in scenarios) + _NOTES
    print(text)
    write_outputs(args.output, {**info, "scenarios": scenarios}, text)
    return 0


def _stand_in_repo(repo: Path) -> Path:
    (repo / MODEL / "1").mkdir(parents=True)
    (repo / MODEL / "config.pbtxt").write_text(CONFIG.format(model=MODEL, backend=BACKEND, instances=1, batching=""))
    return repo


def _probed(work: Path, name: str) -> tuple[dict[str, str], Path]:
    """The environment of a process the probes trace (they write under the returned folder)."""
    traces = work / f"trace-{name}"
    traces.mkdir()
    path = os.pathsep.join(p for p in (str(work / "site"), str(BENCH_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, TRACE_VARIABLE: str(traces)}, traces


def _served(args: argparse.Namespace, repo: Path, workers: int, work: Path) -> dict[str, Any]:
    env, traces = _probed(work, f"http-{workers}")
    http_port = free_port()
    ports = ["--http-port", str(http_port), "--grpc-port", str(free_port()), "--metrics-port", str(free_port())]
    serve = [sys.executable, "-m", "kiln.cli"]
    if args.stand_in:
        serve = [sys.executable, str(BENCH_DIR / "served_ceiling.py"), "--serve-child", "--stand-in-ms=0.5",
                 "--stand-in-row-us=0"]
    command = [*serve, "serve", "--model-repository", str(repo), *ports, "--http-workers", str(workers)]
    with open(work / f"serve-{workers}.log", "wb") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(f"127.0.0.1:{http_port}", server, 120.0)
            measured = _bench(args, work / f"bench-{workers}.json", os.environ,
                              "-u", f"127.0.0.1:{http_port}", "--target", "http",
                              "--load-generator", args.load_generator)
        finally:
            stop(server)
    roles = collections.defaultdict(lambda: "worker", {server.pid: "server"})
    return {"scenario": f"kiln serve, HTTP, --http-workers {workers}", "http_workers": workers, **measured,
            **_stages(traces, roles, SERVED_START)}


def _direct(args: argparse.Namespace, repo: Path, work: Path) -> dict[str, Any]:
    env, traces = _probed(work, "direct")
    measured = _bench(args, work / "bench-direct.json", env, "--target", "direct", "--direct-calls", "asyncio",
                      "--model-repository", str(repo))
    return {"scenario": "direct: kiln.load, asyncio calls", "http_workers": None, **measured,
            **_stages(traces, collections.defaultdict(lambda: "direct"), DIRECT_START)}


def _bench(args: argparse.Namespace, output: Path, env: Any, *target: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "kiln.cli", "bench", "-m", args.model, *target, "--concurrency", "1",
               "-p", str(int(args.seconds * 1000)), "-r", "3", "-s", "50", "--json", str(output), "--quiet"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.seconds * 10 + 180)
    if done.returncode != 0 or not output.exists():
        raise RuntimeError(f"kiln bench failed ({done.returncode}): {done.stderr[-3000:]}")
    (level,) = json.loads(output.read_text())["results"]
    return {"client_p50_ms": level["latency_ms"]["p50"], "requests_per_s": level["throughput_infer_per_s"]}


def _stages(traces: Path, roles: dict[int, str], start: str) -> dict[str, Any]:
    """The median gap of each step of the most common event sequence of the requests traced under ``traces``."""
    events: list[tuple[int, str, str]] = []
    for file in traces.glob("*.txt"):
        role = roles[int(file.stem)]
        for line in file.read_text().splitlines():
            ns, stage = line.split()
            events.append((int(ns), role, stage))
    events.sort()
    requests: list[list[tuple[int, str, str]]] = []
    for event in events:
        if event[2] == start:
            requests.append([event])
        elif requests:
            requests[-1].append(event)
    if len(requests) < 10:
        raise RuntimeError(f"only {len(requests)} requests were traced under {traces}: a probe that no longer "
                           f"matches kiln's code stops them all (Python prints 'Error in sitecustomize' in the "
                           f"traced process's output)")
    begins = [request[0][0] for request in requests]
    cycles = [(b - a) / 1000 for a, b in zip(begins, begins[1:], strict=False)]
    measured = requests[int(len(requests) * WARM_UP_SHARE):-1]  # the last may be cut off
    sequences = collections.Counter(tuple((role, stage) for _, role, stage in r) for r in measured)
    common, count = sequences.most_common(1)[0]
    kept = [r for r in measured if tuple((role, stage) for _, role, stage in r) == common]
    steps = [{"from": common[i - 1][1], "to": common[i][1], "process": common[i][0],
              "median_us": statistics.median((r[i][0] - r[i - 1][0]) / 1000 for r in kept)}
             for i in range(1, len(common))]
    traced = statistics.median((r[-1][0] - r[0][0]) / 1000 for r in kept)
    cycle = statistics.median(cycles[int(len(cycles) * WARM_UP_SHARE):])
    return {"requests": len(measured), "sequence_share": count / len(measured), "cycle_us": cycle,
            "traced_us": traced, "outside_us": cycle - traced, "steps": steps}


def _scenario_text(scenario: dict[str, Any]) -> str:
    rows = [[step["process"], f"{step['from']} -> {step['to']}", step["median_us"]] for step in scenario["steps"]]
    rows.append(["client, kernel", "answer written -> next request's first byte", scenario["outside_us"]])
    return (f"## {scenario['scenario']}\n\nclient p50 {scenario['client_p50_ms']:.3f} ms, "
            f"{scenario['requests_per_s']:,.0f} requests/s; a request's cycle (first byte to the next request's) "
            f"{scenario['cycle_us']:,.0f} us, {scenario['traced_us']:,.0f} of it traced; {scenario['requests']:,} "
            f"requests, {scenario['sequence_share']:.0%} of them in this sequence\n\n"
            + table(["process", "step", "median us"], rows, numeric_from=2) + "\n")


_NOTES = """
Each row is the median time from one probe's event to the next; a name ending in .end is its function's return. The
medians of the steps need not add up to the median cycle. The probes add about a microsecond each.
"""


if __name__ == "__main__":
    sys.exit(main())
