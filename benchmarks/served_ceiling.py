"""What `kiln serve` can feed to an accelerator over HTTP and gRPC, measured without one.

The device stand-in of scheduler_ceiling.py (stages each batch's rows like the PyTorch backend, then waits
``base + per_row x rows`` without the GIL, and can be launched from the event loop like a CUDA graph lane) serves a
model shaped like the demo ResNet-50 built with FP16 inputs: one 3x224x224 FP16 image in (301 KB), 1000 FP32 values
out. tritonclient threads spread over --client-processes processes send batch-1 requests with the image in the
request body or in system shared memory, as benchmarks/shm_gpu.py does on a GPU. Each row prints requests/s and the
average batch the server formed (from its statistics): requests that reach the server one loop turn apart must
still leave as batches. Each row also says where the CPU went while it ran (psutil): the server's core process, its
busiest thread (the event loop, when one thread is the limit), the HTTP/gRPC worker processes together, and the
whole machine's idle share, so a row that falls short names the resource that stopped it.

    python benchmarks/served_ceiling.py --output benchmarks/results/served_ceiling-<date>.json
    python benchmarks/served_ceiling.py --http-workers 1,4 --rows "http:request body"   # 1 vs 4 HTTP processes
    python benchmarks/served_ceiling.py --load-generator perf_analyzer    # NVIDIA's C++ client instead of tritonclient

The server runs as ``python benchmarks/served_ceiling.py --serve-child KILN_SERVE_ARGS...``, which registers the
stand-in backend and then runs `kiln serve`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _common import describe, header, int_list, table, write_outputs
from scheduler_ceiling import BACKEND, DeviceStandIn
from shm_gpu import ClientWork, served_rate

from kiln.bench.resources import CpuMeter
from kiln.serve_process import free_port, stop, wait_ready

MODEL = "resnet50"  # the name benchmarks/shm_gpu.py's client requests use
CONFIG = """
name: "{model}" backend: "{backend}" max_batch_size: 64
input [ {{ name: "input" data_type: TYPE_FP16 dims: [ 3, 224, 224 ] }} ]
output [ {{ name: "output" data_type: TYPE_FP32 dims: [ 1000 ] }} ]
instance_group [ {{ kind: KIND_CPU count: {instances} }} ]
dynamic_batching {{ {batching} }}
"""
ROWS = "http:request body,http:system shm,grpc:request body,grpc:system shm"


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--serve-child"]:
        return _serve_child(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="16")
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--preferred", default="8,32", help="preferred_batch_size list ('' for none)")
    parser.add_argument("--rows", default=ROWS, help=f"protocol:tensors pairs (default: {ROWS})")
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--base-ms", type=float, default=1.0, help="stand-in device time per batch")
    parser.add_argument("--per-row-us", type=float, default=30.0, help="stand-in device time per image")
    parser.add_argument("--http-workers", default="1",
                        help="`kiln serve --http-workers` values, comma-separated: every row runs against each")
    parser.add_argument("--serve-args", default="", help="more `kiln serve` arguments, e.g. '--grpc-workers 2'")
    parser.add_argument("--load-generator", choices=("tritonclient", "perf_analyzer"), default="tritonclient",
                        help="perf_analyzer: NVIDIA's C++ client (--perf-analyzer PATH or $KILN_PERF_ANALYZER)")
    parser.add_argument("--perf-analyzer", default=None, help="the perf_analyzer binary")
    parser.add_argument("--output", type=Path, default=None, help="JSON results; a .txt beside it gets the table")
    args = parser.parse_args(argv)
    preferred = f"preferred_batch_size: [ {args.preferred} ]" if args.preferred else ""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-served-ceiling-") as tmp:
        repo = Path(tmp) / "repo"
        (repo / MODEL / "1").mkdir(parents=True)
        (repo / MODEL / "config.pbtxt").write_text(CONFIG.format(model=MODEL, backend=BACKEND,
                                                                 instances=args.instances, batching=preferred))
        settings = [f"--stand-in-ms={args.base_ms}", f"--stand-in-row-us={args.per_row_us}"]
        for workers in int_list(args.http_workers):
            serve_args = ["--http-workers", str(workers), *args.serve_args.split()]
            with serve_stand_in(repo, settings, serve_args, Path(tmp) / "serve.log") as (http_url, grpc_url,
                                                                                         metrics_url, pid):
                for row in args.rows.split(","):
                    protocol, tensors = row.split(":")
                    for concurrency in int_list(args.concurrency):
                        with _cpu_use(pid) as cpu:
                            measured = _row(protocol, tensors, http_url, grpc_url if protocol == "grpc" else http_url,
                                            metrics_url, concurrency, args)
                        served = measured.pop("served_requests")
                        cpu["core_faults_per_request"] = cpu.pop("core_faults") / served if served else 0.0
                        cpu["worker_faults_per_request"] = cpu.pop("worker_faults") / served if served else 0.0
                        rows.append({"http_workers": workers, **measured, "cpu": cpu})
                        print(rows[-1], flush=True)
    info = describe("kiln served ceiling: kiln serve against a device stand-in",
                    stand_in=f"{args.base_ms:g} ms per batch + {args.per_row_us:g} us per image; {args.instances} "
                             f"instance(s), preferred [{args.preferred}]; load: " + (
                                 "perf_analyzer" if args.load_generator == "perf_analyzer"
                                 else f"tritonclient in {args.client_processes} client processes") + "; "
                             f"{args.seconds:g} s per row; serve arguments: {args.serve_args or '-'}")
    text = header(info) + "\n" + table(
        ["protocol", "tensors", "http workers", "conc", "req/s", "p50 ms", "avg batch", "reqs/call", "core cpu",
         "busiest thread", "workers cpu", "busiest worker", "machine idle", "faults/req core", "faults/req workers"],
        [[r["protocol"], r["tensors"], r["http_workers"], r["concurrency"], r["requests_per_s"],
          "-" if r.get("p50_ms") is None else f"{r['p50_ms']:.2f}", f"{r['average_batch']:.2f}",
          f"{r['requests_per_call']:.2f}", f"{r['cpu']['core']:.2f}", f"{r['cpu']['busiest_thread']:.2f}",
          f"{r['cpu']['workers']:.2f}", f"{r['cpu']['busiest_worker']:.2f}", f"{r['cpu']['machine_idle']:.0%}",
          f"{r['cpu']['core_faults_per_request']:.1f}", f"{r['cpu']['worker_faults_per_request']:.1f}"]
         for r in rows],
        numeric_from=2)
    text += ("\nreqs/call: clients' requests per request the core process received (above 1 where worker processes "
             "joined them; kiln_inference_joined_* metrics)\ncpu columns: cores used on average during the row (1.00 "
             "= one core busy all the time); busiest thread: the core process's busiest thread; busiest worker: the "
             "frontend worker process that used the most\nfaults/req: minor page faults per request served, in the "
             "core process and in the workers together (memory given back to the kernel and faulted in again)\n")
    print(text)
    write_outputs(args.output, {**info, "rows": rows}, text)
    return 0


@contextlib.contextmanager
def serve_stand_in(repo: Path, settings: list[str], serve_args: list[str], log: Path,
                   environment: dict[str, str] | None = None) -> Iterator[tuple[str, str, str, int]]:
    """`kiln serve --allow-client-shm` over ``repo``, started through this script so the stand-in is registered
    (``environment``: variables set for it besides this process's); yields its HTTP, gRPC and metrics
    ``host:port`` and its process id."""
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    command = [sys.executable, __file__, "--serve-child", *settings, "serve", "--model-repository", str(repo),
               "--allow-client-shm", "true", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
               "--metrics-port", str(metrics_port), *serve_args]
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(environment or {})})
        try:
            wait_ready(f"127.0.0.1:{http_port}", process, 60.0)
            yield f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", f"127.0.0.1:{metrics_port}", process.pid
        finally:
            stop(process)


def _serve_child(argv: list[str]) -> int:
    from kiln.cli import main as kiln_main
    from kiln.engines import register_backend

    while argv and argv[0].startswith("--stand-in-"):
        name, value = argv.pop(0).split("=")
        if name == "--stand-in-ms":
            DeviceStandIn.base_s = float(value) / 1000
        else:
            DeviceStandIn.per_row_s = float(value) / 1e6
    register_backend(BACKEND, DeviceStandIn)
    return kiln_main(argv)


def _row(protocol: str, tensors: str, http_url: str, url: str, metrics_url: str, concurrency: int,
         args: argparse.Namespace) -> dict[str, Any]:
    import tritonclient.http as httpclient

    stats = httpclient.InferenceServerClient(http_url)
    meta = stats.get_model_metadata(MODEL)
    (inp,), (out,) = meta["inputs"], meta["outputs"]
    before = _counts(stats)
    joined_before = _joined(metrics_url)
    started = time.perf_counter()
    p50_ms: float | None = None
    if args.load_generator == "perf_analyzer":
        rate, p50_ms = _perf_analyzer_rate(args, protocol, tensors, url, concurrency)
    else:
        image = np.random.default_rng(0).standard_normal([1, 3, 224, 224]).astype(np.float16)
        work = ClientWork(protocol, url, tensors, inp, out, image, 1000 * 4, args.seconds)
        rate = served_rate(work, concurrency, args.client_processes)
    elapsed = time.perf_counter() - started
    after = _counts(stats)
    joined, members, success = (a - b for a, b in zip(_joined(metrics_url), joined_before, strict=True))
    calls = success - members + joined
    executions = after[1] - before[1]
    return {"protocol": protocol, "tensors": tensors, "concurrency": concurrency, "requests_per_s": rate,
            "p50_ms": p50_ms, "average_batch": (after[0] - before[0]) / executions if executions else 0.0,
            "requests_per_call": success / calls if calls else 0.0, "row_seconds": elapsed,
            "served_requests": success}


def _perf_analyzer_rate(args: argparse.Namespace, protocol: str, tensors: str, url: str,
                        concurrency: int) -> tuple[float, float]:
    """Requests/s and p50 latency (ms) of one perf_analyzer run at ``concurrency``: windows of --seconds, at most
    three, the last stable pair reported."""
    from kiln.bench.perf_analyzer import find_binary, read_row, wait_watched

    with tempfile.TemporaryDirectory(prefix="kiln-served-ceiling-pa-") as tmp:
        csv_path = Path(tmp) / "row.csv"
        command = [find_binary(args.perf_analyzer), "-m", MODEL, "-u", url, "-i", protocol,
                   "--concurrency-range", f"{concurrency}:{concurrency}",
                   "--measurement-interval", str(int(args.seconds * 1000)), "--stability-percentage", "25",
                   "--max-trials", "3", "-f", str(csv_path)]
        if tensors == "system shm":
            command += ["--shared-memory", "system", "--output-shared-memory-size", str(1000 * 4)]
        log_path = Path(tmp) / "output.txt"
        with log_path.open("w") as log, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT) as process:
            try:  # its memory grows per request (kiln.bench.perf_analyzer): stopped before the OOM killer picks
                code = wait_watched(process, args.seconds * 6 + 60, None, MODEL,
                                    lambda: log_path.read_text()[-2000:])
            finally:
                if process.poll() is None:
                    process.kill()
        if code != 0 and not csv_path.exists():
            raise RuntimeError(f"perf_analyzer failed ({code}): {log_path.read_text()[-4000:]}")
        row = read_row(csv_path)
    return float(row["Inferences/Second"]), float(row["p50 latency"]) / 1000


@contextlib.contextmanager
def _cpu_use(pid: int) -> Iterator[dict[str, float]]:
    """Fills the yielded dict, once the block ends, with the cores the server's core process, its busiest thread and
    its child processes (frontend workers) used on average during the block (kiln bench's CpuMeter), the machine's
    idle share, and the minor page faults of the core and of the workers."""
    import psutil

    pids = [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    faults = {p: _minor_faults(p) for p in pids}
    meter = CpuMeter(pid)
    meter.start()
    use: dict[str, float] = {}
    yield use
    cpu = meter.stop()
    if cpu is None:
        raise RuntimeError(f"the server process {pid} could not be read")
    use.update(core=cpu.process, busiest_thread=cpu.busiest_thread, workers=cpu.children,
               busiest_worker=cpu.busiest_child, machine_idle=cpu.machine_idle_pct / 100,
               core_faults=_minor_faults(pid) - faults[pid],
               worker_faults=sum(_minor_faults(p) - faults[p] for p in pids[1:]))


def _minor_faults(pid: int) -> int:
    """The process's minor page faults so far (Linux's /proc; 0 elsewhere): memory given back to the kernel and
    faulted in again shows here."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[7])
    except OSError:
        return 0


def _joined(metrics_url: str) -> tuple[float, float, float]:
    """The model's joined requests, the clients' requests they carried, and its successful requests (metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=10).read().decode()
    # Keyed by family: the parser reports a counter sample as <name>_total.
    values = {family.name: sample.value for family in text_string_to_metric_families(text)
              for sample in family.samples if sample.labels.get("model") == MODEL}
    return (values.get("kiln_inference_joined_request_success", 0.0),
            values.get("kiln_inference_joined_member_success", 0.0), values.get("nv_inference_request_success", 0.0))


def _counts(client: Any) -> tuple[int, int]:
    stats = client.get_inference_statistics(MODEL)["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


if __name__ == "__main__":
    raise SystemExit(main())
