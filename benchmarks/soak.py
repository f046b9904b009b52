"""The soak test: a long run of mixed, checked traffic against one `kiln serve`, with versions published, a model
unloaded and loaded, and misbehaving clients, while the server's memory, descriptors, threads and latency are
sampled. It answers: does kiln stay flat and correct for hours?

The server serves the demo models the traffic uses (`kiln demo-repo`), with client shared memory allowed, in
explicit model-control mode (--control-mode poll: poll mode, the server finding changed folders itself). `mlp`
keeps its two newest versions loaded (`version_policy { latest { num_versions: 2 } }`) and splits its traffic
between them by kiln's A/B routing (docs/ab-testing.md).

Traffic, concurrently, from client processes (so no client is capped by its own GIL), every answer checked
against numpy:

* --http-clients and --grpc-clients processes (the official tritonclient), each cycling at --rate operations/s
  through: `simple` with a JSON body, with binary tensors, and in system shared memory (the regions are replaced,
  unregistered and destroyed every --shm-rotate-every requests); `mlp` without a version (A/B routed, half the calls
  with a sticky `routing_key`); the `mlp_pipeline` ensemble; `simple_string` (Python backend, BYTES); a whole
  sequence of 2-5 requests on `simple_dyna_sequence`; over gRPC also a `repeat_int32` stream (decoupled).
* one chaos process: raw HTTP connections closed mid-headers, mid-body and right after the request
  (--cut-rate/s), --slow-clients clients trickling a request --slow-chunk-bytes at a time --slow-chunk-delay-ms
  apart and checking the answer, and gRPC streams cancelled after the first of several delayed responses
  (--cancel-rate/s).

Meanwhile: every --publish-every seconds a new `mlp` version is published (its newest version folder copied to
the next number, then the repository load API, or in poll mode a wait until the version is ready; the A/B weights
move to the two newest versions and folders older than the loaded pair are deleted); every --toggle-every seconds
`simple_string` is unloaded and, --toggle-down seconds later, loaded again (poll mode: its folder moved out of the
repository and back). Every --sample-seconds: the RSS, open descriptors, threads and shared-memory mappings (a
/dev/shm file or a memfd) of the server's process and all its children (psutil), their CPU, the /dev/shm entries
that were not there before the server started, and per window the requests, p50/p99 latency, wrong answers and
failures.

What counts (a well-formed request is any request the traffic processes send; chaos connections are not):

* a **wrong answer**: the server answered, and the answer differs from the reference.
* a **failure**: a well-formed request that got an error or no answer, unless it went to `simple_string` and its
  own interval [sent, ended] overlaps an outage of that model, from just before the unload call (or the move of its
  folder) to the moment the load call returned (or the model was ready again): those are counted apart as
  "unavailable by design". Shared-memory register calls count too.
* slow clients cut by the server (its header or body timeout) are counted apart, never as failures; keep
  --slow-chunk-bytes / --slow-chunk-delay-ms inside the server's timeouts so that they are realistic load.

The bar, after a warm-up (--warmup-minutes, default the first 5 minutes or a third of a shorter run): the RSS and
the open descriptors stay flat within 5% (the largest sample after the warm-up against the sample that ends it),
the server maps no more shared memory than at the end of the warm-up plus the regions the clients hold at once,
the p99 of every later window is within 1.5x of the warm-up's p99 (the warm-up's first window, a cold start, left
out), zero wrong answers, zero failures, and every publish, unload and load succeeded. Each criterion prints PASS
or FAIL; the exit status is 1 when one fails (0 with --report-only).

    python benchmarks/soak.py                       # 30 minutes
    python benchmarks/soak.py --minutes 1 --output /tmp/soak-smoke

Outputs: --output STEM (default benchmarks/results/soak-<machine>-<date>) gets STEM.json (the time series, the
events and the summary), STEM.png (RSS, descriptors, threads, shared memory, p50/p99 and errors over time) and
STEM.txt.
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from _common import BENCH_DIR, describe, header
from _soak_report import Criteria, merge_windows, plot, summarize, text_report

from kiln.demo import build_demo_repository
from kiln.serve_process import KilnProcess, kiln_serve
from kiln.v2.client import HttpClient

SHM_DIR = Path("/dev/shm")
TOGGLED = "simple_string"
PUBLISHED = "mlp"
MODELS = ("simple", "mlp", "mlp_preprocess", "mlp_postprocess", "mlp_pipeline", TOGGLED, "simple_dyna_sequence",
          "repeat_int32")
_MLP_CONFIG_EXTRA = """
version_policy { latest { num_versions: 2 } }
parameters { key: "kiln.ab.weights" value { string_value: "1:50,2:50" } }
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    duration_s = args.minutes * 60
    windows = max(2, round(duration_s / args.sample_seconds))
    warmup_s = (args.warmup_minutes * 60 if args.warmup_minutes is not None else min(300.0, duration_s / 3))
    warmup_windows = min(windows - 1, max(1, round(warmup_s / args.sample_seconds)))
    today = datetime.datetime.now(datetime.timezone.utc)
    output = args.output or BENCH_DIR / "results" / f"soak-{args.machine}-{today:%Y-%m-%d}"
    run, client_windows, log_tail = _soak(args, windows)
    series = merge_windows(run.samples, client_windows, run.events, windows, args.sample_seconds, TOGGLED)
    criteria = Criteria(warmup_windows=warmup_windows, shm_slack=2 * (args.http_clients + args.grpc_clients))
    summary = summarize(series, client_windows, run.events, criteria, TOGGLED, run.server_exit)
    summary["server_at_start"] = next((sample for sample in run.samples if sample["window"] == -1), None)
    info = describe("kiln soak test", duration_minutes=args.minutes, sample_seconds=args.sample_seconds,
                    warmup_windows=warmup_windows)
    text = header(info) + "\n" + text_report(series, summary, run.events)
    if summary["failed_requests"] or summary["wrong_answers"]:
        text += "\nserver log tail:\n" + log_tail
    print(text)
    output.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{output}.json").write_text(json.dumps({"info": info, "arguments": vars(args) | {"output": str(output)},
                                                  "summary": summary, "series": series, "events": run.events},
                                                 indent=1, default=str) + "\n")
    Path(f"{output}.txt").write_text(text)
    plot(series, run.events, warmup_windows, args.sample_seconds, run.t0, TOGGLED, Path(f"{output}.png"))
    return 0 if summary["passed"] or args.report_only else 1


def _soak(args: argparse.Namespace, windows: int) -> tuple[_Run, list[dict[str, Any]], str]:
    """The run itself, in a scratch folder: what was sampled and done, the clients' records, the server log's
    tail."""
    with tempfile.TemporaryDirectory(prefix="kiln-soak-") as tmp:
        repo = _repository(Path(tmp) / "repo")
        control = (["--load-model", "*"] if args.control_mode == "explicit" else
                   ["--repository-poll-secs", str(args.poll_seconds)])
        serve_args = ["--model-control-mode", args.control_mode, *control, "--allow-client-shm", "true",
                      "--exit-timeout-secs", "5", *args.serve_arg]
        run = _Run(args, repo, Path(tmp), windows, _shm_names())
        clients = run.start_clients()  # they import while the server starts
        try:
            with kiln_serve([repo], *serve_args, log_path=Path(tmp) / "serve.log") as server:
                run.go(server, clients)
        finally:
            for client in clients:
                if client.poll() is None:  # the server did not start
                    client.kill()
                    client.wait()
        return run, run.client_windows(), (Path(tmp) / "serve.log").read_text(errors="replace")[-3000:]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--minutes", type=float, default=30.0, help="length of the run (default 30)")
    add("--warmup-minutes", type=float, default=None, help="default: 5, or a third of a shorter run")
    add("--sample-seconds", type=float, default=10.0, help="sample and latency window (default 10)")
    add("--http-clients", type=int, default=2, help="HTTP traffic processes (default 2)")
    add("--grpc-clients", type=int, default=2, help="gRPC traffic processes (default 2)")
    add("--rate", type=float, default=80.0,
        help="operations/s of each traffic process (default 80; a sequence is one operation of 2-5 requests); "
             "tune it by the server's CPU in the output, ~50-70%% of a core is the aim")
    add("--shm-rotate-every", type=int, default=50, help="shared-memory requests per pair of regions")
    add("--cut-rate", type=float, default=2.0, help="connections cut by the chaos process per second")
    add("--cancel-rate", type=float, default=0.5, help="gRPC streams cancelled per second")
    add("--slow-clients", type=int, default=2, help="concurrent slow clients")
    add("--slow-chunk-bytes", type=int, default=32, help="bytes a slow client sends at a time (default 32)")
    add("--slow-chunk-delay-ms", type=float, default=100.0, help="pause between a slow client's chunks")
    add("--control-mode", choices=("explicit", "poll"), default="explicit",
        help="explicit: versions and the toggled model go live through the repository API; poll: kiln finds the "
             "changed folders itself (default explicit)")
    add("--poll-seconds", type=float, default=2.0, help="poll mode: the server's --repository-poll-secs")
    add("--publish-every", type=float, default=30.0, help="seconds between published mlp versions")
    add("--toggle-every", type=float, default=90.0, help=f"seconds between unloads of {TOGGLED}")
    add("--toggle-down", type=float, default=5.0, help=f"seconds {TOGGLED} stays unloaded")
    add("--request-timeout", type=float, default=30.0, help="client timeout of a well-formed request")
    add("--serve-arg", action="append", default=[],
        help="one more `kiln serve` argument (repeatable), e.g. --serve-arg=--http-workers=2")
    add("--machine", default=f"{os.cpu_count()}cpu", help="the machine's name in the default output")
    add("--output", type=Path, default=None, help="output stem: STEM.json, STEM.png, STEM.txt")
    add("--report-only", action="store_true", help="exit 0 even when a criterion fails")
    return parser


def _repository(root: Path) -> Path:
    """The demo models the traffic uses; `mlp` with its versions 1 and 2 (the same files) loaded and A/B routed
    50:50."""
    build_demo_repository(root)
    for unused in {p.name for p in root.iterdir()} - set(MODELS):
        shutil.rmtree(root / unused)
    config = root / PUBLISHED / "config.pbtxt"
    config.write_text(config.read_text() + _MLP_CONFIG_EXTRA)
    shutil.copytree(root / PUBLISHED / "1", root / PUBLISHED / "2")
    return root


@dataclass
class _Run:
    """One soak run: the client processes, the control thread (publish, unload/load) and the sampler."""

    args: argparse.Namespace
    repo: Path
    tmp: Path
    windows: int
    shm_before: set[str]
    samples: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    _outs: list[Path] = field(default_factory=list)
    t0: float = 0.0  # monotonic start of the first window, set once every client is ready
    stop_at: float = 0.0
    server: KilnProcess = field(init=False)
    server_exit: int | None = None  # the server's exit status when it died mid-run
    _stopping: threading.Event = field(default_factory=threading.Event)

    def go(self, server: KilnProcess, clients: list[subprocess.Popen[bytes]]) -> None:
        self.server = server
        control = threading.Thread(target=self._control, daemon=True)
        try:
            self._start_together(clients)
            control.start()
            self._sample_until_stop()
            if self.server_exit is not None:
                self._kill(clients)
        except BaseException:  # Ctrl-C: the clients stop now, not at the end of the run
            self._kill(clients)
            raise
        finally:
            self._stopping.set()
            for client in clients:
                try:
                    client.wait(timeout=max(5.0, self.stop_at - time.monotonic() + self.args.request_timeout + 10))
                except subprocess.TimeoutExpired:
                    client.kill()
                    client.wait()
            if control.ident is not None:  # started
                control.join(timeout=60)
        for index, client in enumerate(clients):
            if client.returncode != 0 and self.server_exit is None:
                log = (self.tmp / f"client-{index}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"soak client {index} exited with status {client.returncode}:\n{log}")

    @staticmethod
    def _kill(clients: list[subprocess.Popen[bytes]]) -> None:
        """SIGTERM, so each writes what it has counted so far; SIGKILL for one that does not end."""
        for client in clients:
            client.terminate()
        for client in clients:
            try:
                client.wait(timeout=10)
            except subprocess.TimeoutExpired:
                client.kill()

    def start_clients(self) -> list[subprocess.Popen[bytes]]:
        """The client processes; each waits for the start signal (:meth:`_start_together`) once it is ready."""
        base = {"start_file": str(self.tmp / "start.json"), "window_s": self.args.sample_seconds,
                "mlp_onnx": str(self.repo / PUBLISHED / "1" / "model.onnx"), "rate": self.args.rate,
                "request_timeout_s": self.args.request_timeout, "shm_rotate_every": self.args.shm_rotate_every,
                "cut_rate": self.args.cut_rate, "cancel_rate": self.args.cancel_rate,
                "slow_clients": self.args.slow_clients, "slow_chunk_bytes": self.args.slow_chunk_bytes,
                "slow_chunk_delay_ms": self.args.slow_chunk_delay_ms}
        protocols = ["http"] * self.args.http_clients + ["grpc"] * self.args.grpc_clients + ["chaos"]
        processes = []
        for index, protocol in enumerate(protocols):
            out = self.tmp / f"client-{index}-{protocol}.jsonl"
            config_path = self.tmp / f"client-{index}.json"
            config_path.write_text(json.dumps({**base, "protocol": protocol, "index": index, "out": str(out),
                                               "ready_file": str(self.tmp / f"client-{index}.ready")}))
            self._outs.append(out)
            with (self.tmp / f"client-{index}.log").open("wb") as log:  # the child keeps its own copy
                processes.append(subprocess.Popen([sys.executable, str(BENCH_DIR / "_soak_traffic.py"),
                                                   str(config_path)], stdout=log, stderr=subprocess.STDOUT))
        return processes

    def _start_together(self, clients: list[subprocess.Popen[bytes]]) -> None:
        """Wait until every client has imported what it needs (a busy machine takes seconds), then give them all
        the server's addresses and the same start and end: ``t0`` is the start of the first sample window."""
        deadline = time.monotonic() + 300
        while not all((self.tmp / f"client-{index}.ready").exists() for index in range(len(clients))):
            for index, client in enumerate(clients):
                if client.poll() is not None:
                    raise RuntimeError(f"soak client {index} exited with status {client.returncode} before the start:"
                                       f"\n{(self.tmp / f'client-{index}.log').read_text(errors='replace')[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("the soak clients were not ready after 300 s")
            time.sleep(0.05)
        self.t0 = time.monotonic() + 0.5
        self.stop_at = self.t0 + self.windows * self.args.sample_seconds
        staging = self.tmp / "start.json.tmp"
        staging.write_text(json.dumps({"t0": self.t0, "stop_at": self.stop_at, "http_url": self.server.http_url,
                                       "grpc_url": self.server.grpc_url}))
        staging.rename(self.tmp / "start.json")  # whole, or not there

    def client_windows(self) -> list[dict[str, Any]]:
        return [json.loads(line) for out in self._outs if out.exists() for line in out.read_text().splitlines()]

    # -- sampling --------------------------------------------------------------------------------------------

    def _sample_until_stop(self) -> None:
        process = psutil.Process(self.server.process.pid)
        cpu_before = _cpu_seconds(process)
        for index in range(self.windows + 1):
            time.sleep(max(0.0, self.t0 + index * self.args.sample_seconds - time.monotonic()))
            if self.server.process.poll() is not None:  # a result in itself: reported, with what led to it
                self.server_exit = self.server.process.returncode
                print(f"kiln serve exited with status {self.server_exit} at t={time.monotonic() - self.t0:.1f}s")
                return
            sample = _process_sample(process, self.shm_before)
            cpu_now = _cpu_seconds(process)
            sample |= {"window": index - 1, "t_s": round(time.monotonic() - self.t0, 2),
                       "cpu_pct": round(100 * (cpu_now - cpu_before) / self.args.sample_seconds, 1)}
            cpu_before = cpu_now
            self.samples.append(sample)
            print(f"t={sample['t_s']:7.1f}s rss {sample['rss_mib']:7.1f} MiB  fds {sample['fds']:4d}  "
                  f"threads {sample['threads']:4d}  shm mapped {sample['shm_mapped']:3d}  "
                  f"/dev/shm new {sample['shm_entries']:3d}  "
                  f"server cpu {sample['cpu_pct']:5.1f}%", flush=True)

    # -- publishing and unloading ----------------------------------------------------------------------------

    def _control(self) -> None:
        """Run the publish and unload/load actions on their schedule until the end."""
        args = self.args
        schedule: list[tuple[float, int, float, Callable[[HttpClient], None]]] = []
        actions: list[tuple[float, float, Callable[[HttpClient], None]]] = [
            (args.publish_every, args.publish_every, self._publish),
            (args.toggle_every / 2, args.toggle_every, self._toggle)]
        for first, every, action in actions:
            heapq.heappush(schedule, (self.t0 + first, len(schedule), every, action))
        with HttpClient(f"http://{self.server.http_url}", timeout_s=120.0) as client:
            while schedule:
                at, order, every, action = heapq.heappop(schedule)
                if at >= self.stop_at - 1.0 or self._stopping.wait(max(0.0, at - time.monotonic())):
                    break
                action(client)
                heapq.heappush(schedule, (at + every, order, every, action))

    def _event(self, action: str, start: float, error: str | None, **extra: object) -> None:
        now = time.monotonic()
        self.events.append({"action": action, "start_s": round(start - self.t0, 3), "end_s": round(now - self.t0, 3),
                            "start": start, "end": now, "error": error, **extra})

    def _publish(self, client: HttpClient) -> None:
        """Copy mlp's newest version folder to the next number, load it, route 50:50 between the newest two and
        delete the folders older than those."""
        folder = self.repo / PUBLISHED
        versions = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())
        new = versions[-1] + 1
        start = time.monotonic()
        staging = folder / f".staging-{new}"
        shutil.copytree(folder / str(versions[-1]), staging)
        staging.rename(folder / str(new))
        if self.args.control_mode == "explicit":
            error = _attempt(lambda: client.load_model(PUBLISHED))
        else:
            error = _attempt(lambda: self._wait_ready(client, PUBLISHED, str(new), True))
        if error is None:
            weights = {str(versions[-1]): 50, str(new): 50}
            error = _attempt(lambda: _set_weights(client, weights))
        self._event("publish", start, error, model=PUBLISHED, version=new)
        for old in versions[:-2]:
            shutil.rmtree(folder / str(old), ignore_errors=True)

    def _toggle(self, client: HttpClient) -> None:
        """Unload the toggled model and load it again --toggle-down seconds later: through the repository API, or
        in poll mode by moving its folder out of the repository and back, each step done once the server shows
        it."""
        folder, parked = self.repo / TOGGLED, self.tmp / f"parked-{TOGGLED}"
        start = time.monotonic()
        if self.args.control_mode == "explicit":
            error = _attempt(lambda: client.unload_model(TOGGLED))
        else:
            folder.rename(parked)
            error = _attempt(lambda: self._wait_ready(client, TOGGLED, "", False))
        self._event("unload", start, error, model=TOGGLED)
        time.sleep(self.args.toggle_down)
        load_start = time.monotonic()
        if self.args.control_mode == "explicit":
            error = _attempt(lambda: client.load_model(TOGGLED))
        else:
            parked.rename(folder)
            error = _attempt(lambda: self._wait_ready(client, TOGGLED, "", True))
        self._event("load", load_start, error, model=TOGGLED)

    def _wait_ready(self, client: HttpClient, model: str, version: str, ready: bool) -> None:
        """Poll mode: wait until the server has found the change (a few poll intervals at most)."""
        limit_s = 10 * self.args.poll_seconds + 30
        deadline = time.monotonic() + limit_s
        while client.model_ready(model, version) != ready:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{model} (version {version or 'any'}) was not {'ready' if ready else 'unloaded'} "
                                   f"{limit_s:.0f} s after its folder changed")
            time.sleep(0.1)


def _attempt(call: Callable[[], object]) -> str | None:
    try:
        call()
    except Exception as exc:  # a control action that fails is reported, and the run goes on
        return f"{type(exc).__name__}: {exc}"
    return None


def _set_weights(client: HttpClient, weights: dict[str, int]) -> None:
    client.post(f"/v2/repository/models/{PUBLISHED}/kiln/routing", {"weights": weights})


def _server_processes(process: psutil.Process) -> list[psutil.Process]:
    return [process, *process.children(recursive=True)]


def _cpu_seconds(process: psutil.Process) -> float:
    total = 0.0
    for proc in _server_processes(process):
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:  # a child that ended between listing and reading
            pass
    return total


def _shm_names() -> set[str]:
    return set(os.listdir(SHM_DIR)) if SHM_DIR.is_dir() else set()


def _process_sample(process: psutil.Process, shm_before: set[str]) -> dict[str, Any]:
    """RSS, descriptors, threads and shared-memory mappings (a /dev/shm file or a memfd) of the server and its
    children; the /dev/shm entries that were not there before the server started (the machine's other users may
    add some too)."""
    rss = fds = threads = 0
    mapped: set[str] = set()
    procs = _server_processes(process)
    for proc in procs:
        try:
            rss += proc.memory_info().rss
            fds += proc.num_fds()
            threads += proc.num_threads()
            mapped |= {m.path for m in proc.memory_maps() if m.path.startswith((str(SHM_DIR) + "/", "/memfd:"))}
        except psutil.Error:  # a child that ended between listing and reading
            pass
    return {"rss_mib": round(rss / 2**20, 2), "fds": fds, "threads": threads, "processes": len(procs),
            "shm_mapped": len(mapped), "shm_entries": len(_shm_names() - shm_before)}


if __name__ == "__main__":
    sys.exit(main())
