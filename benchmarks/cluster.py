"""kiln on Ray Serve (kiln.cluster): throughput of 1, 2, 4 ... replicas, and the latency the Ray path adds to
`kiln serve` on the same machine.

- **Scaling**: a Python model whose every request holds its one instance for ``--work-ms`` without the GIL (a
  sleep, as a device or a native library would), so one replica answers at most 1000/work-ms requests a second and
  N replicas at most N times that. tritonclient (HTTP) clients in ``--client-processes`` processes keep
  ``--concurrency`` requests in flight at the cluster's ingress for ``--duration`` seconds per replica count.
- **Overhead**: `simple` (an add, microseconds of work) at c=1 and c=16, through the cluster's ingress
  (``--ingress``: Serve's HAProxy, the default as in `kiln cluster serve`, or its Python proxy) to one replica and
  straight to a `kiln serve` of the same repository; p50 and p99 of each, and the difference.

A local Ray cluster is started in this process (``ray.init``), one application at a time on it. Bars (printed as
PASS/FAIL): 4 replicas at least ``--scaling-bar`` (3.2) times one replica's throughput; Ray's p50 overhead at c=1
at most ``--overhead-bar-ms`` (2 ms).

    python benchmarks/cluster.py --replicas 1,2,4 --duration 10 \
        --output benchmarks/results/cluster-<machine>-<date>.json
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _common import describe, header, int_list, table, write_outputs

from kiln.demo import build_demo_repository
from kiln.serve_process import free_port, kiln_serve

SLEEPY = "sleepy"
SPAWN_ALLOWANCE_S = 3.0
SLEEPY_CONFIG = """name: "sleepy"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""
SLEEPY_MODEL = """import time


class KilnModel:
    def execute(self, requests):
        answers = []
        for request in requests:
            time.sleep({work_s})  # the GIL is free meanwhile, as during a device's or a native library's work
            answers.append({{"OUTPUT0": request.inputs["INPUT0"]}})
        return answers
"""


# -- load: tritonclient clients in several processes ---------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    requests: int
    failed: int
    seconds: float
    p50_ms: float
    p99_ms: float

    @property
    def per_second(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def _client_process(url: str, model: str, threads: int, window: tuple[float, float, float], queue: Any) -> None:
    """Clients sending back to back from ``window[0]`` (wall clock, shared by every process) until ``window[2]``;
    the requests that end between ``window[1]`` (the warm-up's end) and ``window[2]`` count."""
    import tritonclient.http as httpclient

    begin, counted_from, end = window
    latencies: list[float] = []
    failed = [0]
    lock = threading.Lock()

    def run() -> None:
        client = httpclient.InferenceServerClient(url, network_timeout=60)
        inputs = _inputs(httpclient, model)
        own: list[float] = []
        errors = 0
        time.sleep(max(0.0, begin - time.time()))
        try:
            while time.time() < end:
                started = time.perf_counter()
                try:
                    client.infer(model, inputs)
                    if counted_from <= time.time() <= end:
                        own.append(time.perf_counter() - started)
                except Exception:
                    errors += 1
        finally:
            client.close()
        with lock:
            latencies.extend(own)
            failed[0] += errors

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    queue.put((latencies, failed[0]))


def _inputs(httpclient: Any, model: str) -> list[Any]:
    if model == SLEEPY:
        tensor = httpclient.InferInput("INPUT0", [4], "FP32")
        tensor.set_data_from_numpy(np.ones(4, dtype=np.float32))
        return [tensor]
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    for tensor in inputs:
        tensor.set_data_from_numpy(a)
    return inputs


def drive(url: str, model: str, concurrency: int, processes: int, seconds: float, warmup: float) -> Load:
    """``concurrency`` clients, spread over at most ``processes`` processes, sending back to back: ``warmup``
    seconds, then ``seconds`` measured."""
    processes = max(1, min(processes, concurrency))
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    threads = [concurrency // processes + (1 if i < concurrency % processes else 0) for i in range(processes)]
    begin = time.time() + SPAWN_ALLOWANCE_S  # every process imports tritonclient before the window opens
    window = (begin, begin + warmup, begin + warmup + seconds)
    children = [context.Process(target=_client_process, args=(url, model, n, window, queue)) for n in threads]
    for child in children:
        child.start()
    results = [queue.get(timeout=SPAWN_ALLOWANCE_S + warmup + seconds + 120) for _ in children]
    for child in children:
        child.join()
    latencies = np.array([value for own, _ in results for value in own]) * 1e3
    failed = sum(errors for _, errors in results)
    if not len(latencies):
        return Load(0, failed, seconds, float("nan"), float("nan"))
    return Load(len(latencies), failed, seconds, float(np.percentile(latencies, 50)),
                float(np.percentile(latencies, 99)))


# -- the servers -----------------------------------------------------------------------------------------------------


def build_repository(root: Path, work_ms: float) -> Path:
    repository = root / "repository"
    build_demo_repository(repository)
    (repository / SLEEPY / "1").mkdir(parents=True)
    (repository / SLEEPY / "config.pbtxt").write_text(SLEEPY_CONFIG)
    (repository / SLEEPY / "1" / "model.py").write_text(SLEEPY_MODEL.format(work_s=work_ms / 1e3))
    return repository


class RayServe:
    """A local Ray cluster with Serve's ingress on ``port``; one kiln application at a time."""

    def __init__(self, repository: Path, cpus: int, ingress: str) -> None:
        import ray
        from ray import serve

        from kiln.cluster.ingress import ingress_environment

        self.repository = repository
        self.port = free_port()
        # As `kiln cluster serve` starts a local cluster; a deleted application's replicas drain for 1 s, not 30.
        os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "1")
        os.environ.update(ingress_environment(ingress))
        ray.init(num_cpus=cpus, logging_level=logging.ERROR, log_to_driver=False, include_dashboard=False)
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        self.url = f"127.0.0.1:{self.port}"

    def deploy(self, replicas: int, replica_cpus: float) -> None:
        from ray import serve

        from kiln.cluster import ClusterOptions, build_application

        options = ClusterOptions(self.repository, num_replicas=replicas, num_cpus=replica_cpus)
        serve.run(build_application(options), name=options.name, route_prefix="/")

    def delete(self) -> None:
        from ray import serve

        serve.delete("kiln")

    def close(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()  # type: ignore[no-untyped-call,unused-ignore]
        ray.shutdown()


# -- the runs ------------------------------------------------------------------------------------------------------


def scaling(ray_serve: RayServe, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for replicas in args.replicas:
        ray_serve.deploy(replicas, args.replica_cpus)
        load = drive(ray_serve.url, SLEEPY, args.concurrency, args.client_processes, args.duration, args.warmup)
        ray_serve.delete()
        rows.append({"replicas": replicas, **asdict(load), "per_second": load.per_second})
        print(f"{replicas} replica(s): {load.per_second:,.0f} req/s, {load.failed} failed", flush=True)
    base = rows[0]["per_second"] / rows[0]["replicas"] if rows and rows[0]["per_second"] else float("nan")
    for row in rows:
        row["vs_one"] = row["per_second"] / base if base == base else float("nan")
        row["ceiling_per_second"] = row["replicas"] * 1e3 / args.work_ms
    return rows


def overhead(ray_serve: RayServe, args: argparse.Namespace) -> list[dict[str, Any]]:
    ray_serve.deploy(1, args.replica_cpus)
    rows: list[dict[str, Any]] = []
    try:
        with kiln_serve([ray_serve.repository]) as direct:
            for concurrency in args.latency_concurrency:
                through_ray = drive(ray_serve.url, "simple", concurrency, args.client_processes,
                                    args.latency_duration, args.warmup)
                straight = drive(direct.http_url, "simple", concurrency, args.client_processes,
                                 args.latency_duration, args.warmup)
                rows.append({"concurrency": concurrency, "ray": asdict(through_ray), "kiln_serve": asdict(straight),
                             "p50_overhead_ms": through_ray.p50_ms - straight.p50_ms,
                             "p99_overhead_ms": through_ray.p99_ms - straight.p99_ms,
                             "p50_ratio": through_ray.p50_ms / straight.p50_ms if straight.p50_ms else float("nan")})
                print(f"c={concurrency}: p50 {through_ray.p50_ms:.2f} ms through Ray, {straight.p50_ms:.2f} ms "
                      f"kiln serve", flush=True)
    finally:
        ray_serve.delete()
    return rows


def bars(scaled: list[dict[str, Any]], overheads: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    lines = []
    by_count = {row["replicas"]: row for row in scaled}
    if 1 in by_count and 4 in by_count:
        ratio = by_count[4]["per_second"] / by_count[1]["per_second"] if by_count[1]["per_second"] else 0.0
        verdict = "PASS" if ratio >= args.scaling_bar else "FAIL"
        lines.append(f"{verdict}: 4 replicas {ratio:.2f}x 1 replica (bar >= {args.scaling_bar}x)")
    single = [row for row in overheads if row["concurrency"] == 1]
    if single:
        extra = single[0]["p50_overhead_ms"]
        verdict = "PASS" if extra <= args.overhead_bar_ms else "FAIL"
        lines.append(f"{verdict}: Ray p50 overhead at c=1 {extra:.2f} ms (bar <= {args.overhead_bar_ms} ms)")
    return lines


def report(info: dict[str, Any], scaled: list[dict[str, Any]], overheads: list[dict[str, Any]],
           verdicts: list[str], args: argparse.Namespace) -> str:
    text = header(info) + "\n"
    text += (f"## Throughput by replica count ({SLEEPY}: {args.work_ms} ms per request without the GIL, one instance "
             f"per replica; c={args.concurrency} from {args.client_processes} client processes, "
             f"{args.duration} s each)\n\n")
    text += table(["replicas", "req/s", "x one replica", "ceiling req/s", "failed", "p50 ms", "p99 ms"],
                  [[r["replicas"], r["per_second"], r["vs_one"], r["ceiling_per_second"], r["failed"], r["p50_ms"],
                    r["p99_ms"]] for r in scaled]) + "\n\n"
    text += f"## Latency: the cluster's ingress ({args.ingress}) to one replica vs `kiln serve` (simple)\n\n"
    text += table(["c", "Ray p50 ms", "kiln serve p50 ms", "p50 extra ms", "Ray p99 ms", "kiln serve p99 ms",
                   "p99 extra ms", "p50 ratio"],
                  [[r["concurrency"], r["ray"]["p50_ms"], r["kiln_serve"]["p50_ms"], r["p50_overhead_ms"],
                    r["ray"]["p99_ms"], r["kiln_serve"]["p99_ms"], r["p99_overhead_ms"], r["p50_ratio"]]
                   for r in overheads]) + "\n\n"
    return text + "\n".join(verdicts) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--replicas", type=int_list, default=[1, 2, 4], help="replica counts (default 1,2,4)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load per replica count")
    parser.add_argument("--latency-duration", type=float, default=10.0, help="seconds of load per latency run")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each measured run")
    parser.add_argument("--work-ms", type=float, default=20.0, help="the scaling model's work per request")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight in the scaling runs")
    parser.add_argument("--latency-concurrency", type=int_list, default=[1, 16], help="default 1,16")
    parser.add_argument("--client-processes", type=int, default=4, help="processes the clients run in")
    parser.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs each replica asks Ray for")
    parser.add_argument("--ray-cpus", type=int, default=None,
                        help="CPUs the local Ray cluster declares (default: this machine's, at least the most "
                             "replicas asked for)")
    parser.add_argument("--ingress", choices=("haproxy", "proxy"), default="haproxy",
                        help="Serve's HAProxy ingress straight to the replicas (default, as kiln cluster serve) or "
                             "its Python proxy")
    parser.add_argument("--scaling-bar", type=float, default=3.2, help="4 replicas over 1, at least")
    parser.add_argument("--overhead-bar-ms", type=float, default=2.0, help="Ray's p50 overhead at c=1, at most")
    parser.add_argument("--label", default="", help="a name for the machine in the title (e.g. dev2core)")
    parser.add_argument("--output", type=Path, default=None, help="write JSON here and the text beside it (.txt)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cpus = args.ray_cpus or max(os.cpu_count() or 1, int(max(args.replicas) * args.replica_cpus + 0.999))
    title = "kiln on Ray Serve: replicas and the Ray path's latency" + (f" ({args.label})" if args.label else "")
    with tempfile.TemporaryDirectory(prefix="kiln-cluster-bench") as root:
        ray_serve = RayServe(build_repository(Path(root), args.work_ms), cpus, args.ingress)
        info = describe(title, ray_cpus=cpus, ingress=args.ingress,
                        ray_serve_env={k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")})
        try:
            scaled = scaling(ray_serve, args)
            overheads = overhead(ray_serve, args)
        finally:
            ray_serve.close()
    verdicts = bars(scaled, overheads, args)
    text = report(info, scaled, overheads, verdicts, args)
    print(text)
    write_outputs(args.output, {"info": info, "args": {k: v for k, v in vars(args).items() if k != "output"},
                                "scaling": scaled, "overhead": overheads, "bars": verdicts}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
