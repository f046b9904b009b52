"""``kiln bench compare``: the reference experiment on one model, direct vs served vs served beside other models.

Scenarios, each swept over the same concurrency levels:

- ``direct``: ``kiln.load`` in a child process of its own, N threads calling the engine, so its memory is the
  direct process's and not this one's.
- ``served``: a ``kiln serve`` whose temporary repository holds only the model (its files linked, its config
  rewritten), with and without ``dynamic_batching``.
- ``served_with_others``: the same plus N copies of the model under other names (``<model>_peer1`` ...); while the
  model is measured at concurrency C, one load process per copy keeps C requests outstanding on it.

Every process started here (the direct child, servers, peer load generators) runs in a session of its own and is
stopped in ``finally`` (SIGTERM to its process group, SIGKILL after a grace period), Ctrl-C included.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln._flags import flag
from kiln.bench.data import build_requests
from kiln.bench.machine import machine_info
from kiln.bench.options import (
    BenchOptions,
    load_generator_field,
    output_shared_memory_size_field,
    parse_list,
    perf_analyzer_field,
    shared_memory_field,
)
from kiln.bench.perf_analyzer import find_binary
from kiln.bench.records import Level, Recorder
from kiln.bench.resources import MIB, ByteReader, gpu_reader, rss_reader
from kiln.bench.result import BenchResult, LevelResult
from kiln.bench.runner import run
from kiln.bench.served_counts import CountSampler
from kiln.bench.targets import create_target
from kiln.config.model_dir import open_model_dir
from kiln.config.parse import CONFIG_FILENAME, config_to_text, read_config
from kiln.errors import InvalidArgumentError, UnavailableError
from kiln.serve_process import free_port, wait_ready
from kiln.v2._generated import model_config_pb2 as pb

PROTOCOLS = ("http", "grpc")
BATCHING = {"both": (False, True), "on": (True,), "off": (False,)}  # --batching: the variants measured
MEASUREMENT = "measurement (short by default; raise them for publishable figures)"  # the --help section
LOAD = "served load generator"  # the --help section
STOP_GRACE_S = 10.0
READY_TIMEOUT_S = 120.0
# What _start_server passes `kiln serve` itself: --serve-args may not set them.
SERVER_FLAGS_OF_COMPARE = ("--model-repository", "--model-store", "--http-port", "--grpc-port", "--metrics-port")
SCENARIOS = ("direct", "served", "served_with_others")

Note = Callable[[str], None]


@dataclass(frozen=True)
class CompareOptions:
    """One comparison. ``models`` counts the other models loaded beside the measured one."""

    model: str = field(metadata=flag(metavar="MODEL", help="the model to measure: a folder name in "
                                                             "--model-repository"))
    model_repository: Path = field(metadata=flag(
        "--model-repository", required=True, metavar="REPO",
        help="the repository holding MODEL (left untouched: served scenarios use temporary repositories that link "
             "its files)"))
    concurrency: tuple[int, ...] = field(default=(1, 8, 16), metadata=flag(
        "--concurrency", parse=lambda text: parse_list(text, "--concurrency"), metavar="N,N,...",
        help="concurrency levels, for every scenario (default 1,8,16)"))
    models: int = field(default=3, metadata=flag(
        "--models", metavar="N", help="other models served beside MODEL, copies of it all receiving traffic "
                                      "(default 3)"))
    protocol: str = field(default="http", metadata=flag(
        "--protocol", choices=PROTOCOLS, help="how served scenarios are reached (default http, binary tensors: the "
                                              "faster of the two through kiln's Python clients)"))
    batching: str = field(default="both", metadata=flag(  # see BATCHING
        "--batching", choices=tuple(sorted(BATCHING)),
        help="served scenarios with dynamic_batching on, off, or both (default both)"))
    measurement_interval_ms: int = field(default=1000, metadata=flag(
        "-p", "--measurement-interval", metavar="MS", group=MEASUREMENT, help="window length (default 1000)"))
    max_trials: int = field(default=5, metadata=flag(
        "-r", "--max-trials", group=MEASUREMENT, help="most windows per level (default 5)"))
    stability_percentage: float = field(default=10.0, metadata=flag(
        "-s", "--stability-percentage", group=MEASUREMENT, help="last 3 windows within this %% = stable (default 10)"))
    device: str = field(default="cpu", metadata=flag(
        "--device", choices=("config", "cpu", "gpu"), default="config", group=MEASUREMENT,
        help="direct: where the engine runs (config: where its instance group puts it)"))
    direct_calls: str = field(default="threads", metadata=flag(
        "--direct-calls", choices=("threads", "asyncio"), group=MEASUREMENT,
        help="direct: N threads calling engine.infer (default) or N tasks awaiting engine.ainfer on one loop"))
    # Served scenarios: processes sending the measured model's requests, and each peer's.
    client_processes: int = field(default=1, metadata=flag(
        "--client-processes", metavar="N", group=MEASUREMENT,
        help="served scenarios: send the measured model's requests, and each peer's, from N processes (large "
             "tensors: one Python client process is slower than the server)"))
    seed: int = field(default=0, metadata=flag("--seed", group=MEASUREMENT, help="seed of the random input data"))
    # What sends the measured model's requests in the served scenarios (the peers' load stays kiln's).
    load_generator: str = load_generator_field(LOAD)
    perf_analyzer: str | None = perf_analyzer_field(LOAD)
    shared_memory: str = shared_memory_field(LOAD)
    output_shared_memory_size: int = output_shared_memory_size_field(LOAD)
    serve_args: str | None = field(default=None, metadata=flag(
        "--serve-args", metavar="'ARGS'",
        help="more `kiln serve` arguments for the served scenarios, in one string after '=' (e.g. "
             "--serve-args='--http-workers 8'): compare a server setting; the repository and the ports stay the "
             "comparison's"))
    work_dir: Path | None = None  # where temporary repositories and logs go (default: a fresh temporary folder)

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise InvalidArgumentError(f"--protocol is '{self.protocol}'; expected one of: {', '.join(PROTOCOLS)}")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise InvalidArgumentError(f"--concurrency levels must be >= 1, got {list(self.concurrency)}")
        if self.models < 1:
            raise InvalidArgumentError(f"--models must be >= 1 (the other models beside '{self.model}'), "
                                       f"got {self.models}")
        if self.batching not in BATCHING:
            raise InvalidArgumentError(f"--batching is '{self.batching}'; expected one of: {', '.join(BATCHING)}")
        if self.client_processes < 1:
            raise InvalidArgumentError(f"--client-processes must be >= 1, got {self.client_processes}")
        self.serve_words()
        self.bench_options()  # the measurement settings, checked before any process starts
        self.served_options("127.0.0.1:1", 1)  # and the served rows' (no server yet: a placeholder URL)
        if not (self.model_repository / self.model).is_dir():
            raise InvalidArgumentError(f"model '{self.model}' has no folder in --model-repository "
                                       f"{self.model_repository} (expected {self.model_repository / self.model})")

    def serve_words(self) -> list[str]:
        """--serve-args as `kiln serve` arguments; the flags the comparison sets itself are refused."""
        try:
            words = shlex.split(self.serve_args or "")
        except ValueError as exc:
            raise InvalidArgumentError(f"--serve-args '{self.serve_args}' cannot be split into arguments: {exc}; "
                                       f"expected `kiln serve` flags in one quoted string") from None
        owned = [word for word in words if _names_owned_flag(word.split("=", 1)[0])]
        if owned:
            raise InvalidArgumentError(f"--serve-args sets {', '.join(owned)}, which kiln bench compare sets itself "
                                       f"(the served scenarios' repository and free ports); expected other "
                                       f"`kiln serve` flags")
        return words

    def bench_options(self, **changes: Any) -> BenchOptions:
        settings: dict[str, Any] = {"model": self.model, "measurement_interval_ms": self.measurement_interval_ms,
                                    "max_trials": self.max_trials, "seed": self.seed,
                                    "stability_percentage": self.stability_percentage}
        settings.update(changes)
        return BenchOptions(**settings)

    def served_options(self, url: str, concurrency: int, server_pid: int | None = None) -> BenchOptions:
        """The bench of the measured model in a served scenario. perf_analyzer is one process of its own, so
        --client-processes then applies to the peers' load only."""
        external = self.load_generator == "perf_analyzer"
        return self.bench_options(target=self.protocol, url=url, server_pid=server_pid, concurrency=(concurrency,),
                                  client_processes=1 if external else self.client_processes,
                                  load_generator=self.load_generator, perf_analyzer=self.perf_analyzer,
                                  shared_memory=self.shared_memory,
                                  output_shared_memory_size=self.output_shared_memory_size)


def _names_owned_flag(name: str) -> bool:
    """``name`` is one of SERVER_FLAGS_OF_COMPARE or, as argparse reads an abbreviation, the start of one."""
    return len(name) > 2 and name.startswith("--") and any(flag.startswith(name) for flag in SERVER_FLAGS_OF_COMPARE)


# -- processes ---------------------------------------------------------------------------------------------------


@dataclass
class Child:
    """A process this comparison started, in its own session so its whole group can be stopped."""

    role: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL once the grace period is over; always reaps the process."""
        if self.process.poll() is None:
            _signal_group(self.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.pid, signal.SIGKILL)  # stragglers the leader left behind
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Processes:
    """Starts children and stops every one of them on exit, in reverse order."""

    log_dir: Path
    started: list[Child] = field(default_factory=list)

    def start(self, role: str, command: Sequence[str], pipes: bool = False) -> Child:
        log_path = self.log_dir / f"{role}.log"
        with open(log_path, "wb") as log:
            pipe = subprocess.PIPE if pipes else subprocess.DEVNULL
            # Unbuffered pipes: a line the child wrote is either readable by select() or not yet sent.
            process = subprocess.Popen(list(command), stdin=pipe, stdout=pipe if pipes else log, stderr=log,
                                       start_new_session=True, bufsize=0)
        child = Child(role, process, log_path)
        self.started.append(child)
        return child

    def stop_all(self) -> None:
        for child in reversed(self.started):
            child.stop()


def read_line(child: Child, timeout_s: float) -> str:
    """The child's next stdout line; UnavailableError when it exits or stays silent past the timeout."""
    stdout = child.process.stdout
    assert stdout is not None
    ready, _, _ = select.select([stdout], [], [], timeout_s)
    line = stdout.readline().decode().strip() if ready else ""
    if not line:
        state = "exited" if child.process.poll() is not None else f"said nothing for {timeout_s:.0f} s"
        raise UnavailableError(f"kiln bench compare: the {child.role} process {state}\n{child.log_tail()}")
    return line


def _module_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "kiln.bench.compare", *args]


# -- repositories ------------------------------------------------------------------------------------------------


def base_config(model_path: Path) -> pb.ModelConfig:
    """The model's config.pbtxt as written, or its auto-completed config when the folder has none."""
    config = read_config(model_path)
    return config if config is not None else open_model_dir(model_path).spec.config


def write_repository(root: Path, source: Path, config: pb.ModelConfig, names: Sequence[str], batching: bool) -> Path:
    """A repository holding ``source`` under each name: its files linked, its config renamed and with or without
    ``dynamic_batching`` (max_batch_size kept)."""
    root.mkdir(parents=True)
    for name in names:
        folder = root / name
        folder.mkdir()
        for entry in source.iterdir():
            if entry.name != CONFIG_FILENAME:
                (folder / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
        variant = pb.ModelConfig()
        variant.CopyFrom(config)
        variant.name = name
        if batching:
            variant.dynamic_batching.SetInParent()
        else:
            variant.ClearField("dynamic_batching")
        (folder / CONFIG_FILENAME).write_text(config_to_text(variant), encoding="utf-8")
    return root


# -- the comparison ----------------------------------------------------------------------------------------------


class Comparison:
    """Runs the scenarios of :class:`CompareOptions`; ``pids`` lists every process it started."""

    def __init__(self, options: CompareOptions, note: Note | None = None) -> None:
        self.options = options
        self.note = note if note is not None else (lambda _text: None)
        self.pids: list[int] = []
        self.notes: list[str] = []

    def run(self, on_progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Measure every scenario; ``on_progress`` gets the document so far after each one but the last (marked
        partial), so a run stopped midway still leaves what it measured."""
        opts = self.options
        config = base_config(opts.model_repository / opts.model)
        batching = list(BATCHING[opts.batching])
        if config.max_batch_size == 0 and True in batching:
            batching.remove(True)
            self.notes.append(f"model '{opts.model}' has max_batch_size 0: dynamic batching cannot apply, so only "
                              "the variants without it ran")
        if not batching:
            raise InvalidArgumentError(f"model '{opts.model}' has max_batch_size 0, so it has no variant with "
                                       "dynamic batching; use --batching off (or both)")
        served = [(name, peers, batched) for name, peers in (("served", 0), ("served_with_others", opts.models))
                  for batched in batching]
        if opts.load_generator == "perf_analyzer":
            find_binary(opts.perf_analyzer)  # missing: fail before any scenario runs
            self.notes.append(f"served rows: the measured model's requests come from perf_analyzer (NVIDIA's C++ "
                              f"client, {opts.protocol}, shared memory {opts.shared_memory}); the peer models' load "
                              f"and the direct rows come from kiln")
        machine = machine_info()
        with ExitStack() as stack:
            work = opts.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kiln-compare-")))
            scenarios = [self._direct(work)]
            for name, peers, batched in served:
                if on_progress is not None:
                    on_progress(self._document(machine, scenarios, planned=1 + len(served)))
                scenarios.append(self._served(work, config, name, peers, batched))
        return self._document(machine, scenarios, planned=len(scenarios))

    def _document(self, machine: dict[str, Any], scenarios: list[dict[str, Any]], planned: int) -> dict[str, Any]:
        opts = self.options
        notes = list(self.notes)
        if len(scenarios) < planned:
            notes.append(f"partial: {len(scenarios)} of {planned} scenarios measured so far; the run did not finish")
        return {"model": opts.model, "machine": machine, "concurrency": list(opts.concurrency),
                "protocol": opts.protocol, "scenarios": list(scenarios), "memory_mb": memory_summary(scenarios),
                "settings": {"measurement_interval_ms": opts.measurement_interval_ms, "max_trials": opts.max_trials,
                             "stability_percentage": opts.stability_percentage, "device": opts.device,
                             "client_processes": opts.client_processes, "load_generator": opts.load_generator,
                             "shared_memory": opts.shared_memory, "serve_args": opts.serve_words()},
                "notes": notes}

    @contextmanager
    def _processes(self, log_dir: Path) -> Iterator[Processes]:
        log_dir.mkdir(parents=True, exist_ok=True)
        processes = Processes(log_dir)
        try:
            yield processes
        finally:
            self.pids.extend(child.pid for child in processes.started)
            processes.stop_all()

    def _direct(self, work: Path) -> dict[str, Any]:
        opts = self.options
        self.note(f"direct: kiln.load in a child process, {opts.direct_calls}, concurrency {list(opts.concurrency)}")
        out = work / "direct.json"
        bench = {"model": opts.model, "model_repository": str(opts.model_repository.resolve()),
                 "concurrency": list(opts.concurrency), "device": opts.device, "direct_calls": opts.direct_calls}
        with self._processes(work / "logs") as processes:
            child = processes.start("direct", _module_command("direct", json.dumps(bench), str(out),
                                                               json.dumps(self._settings())))
            child.process.wait()
            if child.process.returncode != 0:
                raise UnavailableError(f"kiln bench compare: the direct run failed (exit status "
                                       f"{child.process.returncode})\n{child.log_tail()}")
        result = BenchResult.from_json(out.read_text(encoding="utf-8"))
        rows = result.results
        first = rows[0].memory_mb if rows else None
        return _scenario("direct", False, 1, rows, first.rss_idle if first else None, first.gpu_idle if first else None)

    def _settings(self) -> dict[str, Any]:
        opts = self.options
        return {"measurement_interval_ms": opts.measurement_interval_ms, "max_trials": opts.max_trials,
                "stability_percentage": opts.stability_percentage, "seed": opts.seed}

    def _served(self, work: Path, config: pb.ModelConfig, name: str, peers: int, batching: bool) -> dict[str, Any]:
        opts = self.options
        label = f"{name}{'_batching' if batching else ''}"
        peer_names = [f"{opts.model}_peer{i}" for i in range(1, peers + 1)]
        repo = write_repository(work / label, opts.model_repository / opts.model, config, [opts.model, *peer_names],
                                batching)
        self.note(f"{label}: kiln serve with {1 + peers} model(s), {opts.protocol}, concurrency "
                  f"{list(opts.concurrency)}")
        with self._processes(work / "logs" / label) as processes:
            server, url, http_url = self._start_server(processes, repo)
            idle_rss, idle_gpu = _read_mib(rss_reader(server.pid)), _read_mib(gpu_reader(server.pid, False)[0])
            loads = [processes.start(f"load_{peer}", _module_command("peer", json.dumps(
                {"model": peer, "protocol": opts.protocol, "url": url, "seed": opts.seed,
                 "client_processes": opts.client_processes})), pipes=True)
                for peer in peer_names]
            for load in loads:
                _expect(load, "ready")
            rows: list[LevelResult] = []
            together: dict[int, dict[str, float]] = {}
            batches: dict[int, dict[str, float]] = {}
            for concurrency in opts.concurrency:
                for load in loads:
                    _send(load, f"{concurrency}\n")
                    _expect(load, f"running {concurrency}")
                sampler = CountSampler(http_url)
                sampler.start()
                try:
                    result = run(opts.served_options(url, concurrency, server.pid))
                finally:
                    sampler.stop()
                for level in result.results:
                    if level.window_span_ns is not None:
                        together[concurrency] = sampler.rates(*level.window_span_ns)
                        batches[concurrency] = sampler.rows_per_execution(*level.window_span_ns)
                rows.extend(result.results)
        entry = _scenario(name, batching, 1 + peers, rows, idle_rss, idle_gpu)
        for level in entry["results"]:
            level["server_models_per_s"] = together.get(level["concurrency"])
            level["server_rows_per_execution"] = batches.get(level["concurrency"])
        return entry

    def _start_server(self, processes: Processes, repo: Path) -> tuple[Child, str, str]:
        """`kiln serve` over ``repo``; returns it, the address the measured protocol uses and the HTTP address."""
        http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
        server = processes.start("server", [sys.executable, "-m", "kiln.cli", "serve", "--model-repository", str(repo),
                                            "--http-port", str(http_port), "--grpc-port", str(grpc_port),
                                            "--metrics-port", str(metrics_port), "--exit-timeout-secs", "5",
                                            *(["--allow-client-shm"] if self.options.shared_memory != "none" else []),
                                            *self.options.serve_words()])
        try:
            wait_ready(f"127.0.0.1:{http_port}", server.process, READY_TIMEOUT_S)
        except (RuntimeError, TimeoutError) as exc:
            raise UnavailableError(f"kiln bench compare could not start `kiln serve` over {repo}: {exc}\n"
                                   f"{server.log_tail()}") from None
        port = http_port if self.options.protocol == "http" else grpc_port
        return server, f"127.0.0.1:{port}", f"127.0.0.1:{http_port}"


def _send(child: Child, text: str) -> None:
    stdin = child.process.stdin
    assert stdin is not None
    try:
        stdin.write(text.encode())
        stdin.flush()
    except BrokenPipeError:
        raise UnavailableError(f"kiln bench compare: the {child.role} process exited\n{child.log_tail()}") from None


def _expect(child: Child, expected: str) -> None:
    line = read_line(child, READY_TIMEOUT_S)
    if line != expected:
        raise UnavailableError(f"kiln bench compare: the {child.role} process said '{line}', expected "
                               f"'{expected}'\n{child.log_tail()}")


def _read_mib(reader: ByteReader | None) -> float | None:
    value = reader() if reader is not None else None
    return None if value is None else round(value / MIB, 3)


def _peak(idle: float | None, samples: Sequence[float | None]) -> float | None:
    return max([v for v in (idle, *samples) if v is not None], default=None)


def _scenario(name: str, batching: bool, models: int, rows: list[LevelResult], idle: float | None,
              gpu_idle: float | None) -> dict[str, Any]:
    """A scenario entry; ``idle`` is RSS after load and before any traffic, ``peak`` the highest RSS sampled
    while it was measured (GPU figures the same, None where they cannot be read)."""
    memory = {"idle": idle, "peak": _peak(idle, [r.memory_mb.rss_peak for r in rows]),
              "gpu_idle": gpu_idle, "gpu_peak": _peak(gpu_idle, [r.memory_mb.gpu_peak for r in rows])}
    return {"name": name, "batching": batching, "models_loaded": models,
            "results": [dataclasses.asdict(r) for r in rows], "memory_mb": memory}


def memory_summary(scenarios: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Idle and peak RSS per scenario; for the served ones, the batching variant with the higher peak."""
    summary: dict[str, Any] = {}
    for name in SCENARIOS:
        variants = [s for s in scenarios if s["name"] == name]
        if not variants:
            continue
        chosen = max(variants, key=lambda s: s["memory_mb"]["peak"] or 0.0)
        entry: dict[str, Any] = dict(chosen["memory_mb"])
        if name != "direct":
            entry["batching"] = chosen["batching"]
        if name == "served_with_others":
            entry["models"] = chosen["models_loaded"]
        summary[name] = entry
    return summary


# -- child processes ---------------------------------------------------------------------------------------------


def _direct_main(bench: dict[str, Any], out: Path, settings: dict[str, Any]) -> int:
    options = BenchOptions(model=bench["model"], target="direct", model_repository=Path(bench["model_repository"]),
                           concurrency=tuple(bench["concurrency"]), device=bench["device"],
                           direct_calls=bench.get("direct_calls", "threads"), **settings)
    run(options).write_json(out)
    return 0


def _peer_main(spec: dict[str, Any]) -> int:
    """Keep ``N`` requests outstanding on a peer model; N comes as a line on stdin, EOF or SIGTERM ends it."""
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(0))
    options = BenchOptions(model=spec["model"], target=spec["protocol"], url=spec["url"], seed=spec["seed"],
                           client_processes=spec.get("client_processes", 1))
    recorder = Recorder()
    done = threading.Event()
    threading.Thread(target=_drain, args=(recorder, done), daemon=True).start()
    with create_target(options) as target:
        target.prepare(build_requests(target.open(), "random", 1, {}, spec["seed"]))
        _say("ready")
        running = False
        try:
            for line in sys.stdin:
                if running:
                    target.stop()
                concurrency = int(line)
                target.start(Level(concurrency=concurrency, seed=spec["seed"]), recorder)
                running = True
                _say(f"running {concurrency}")
        finally:
            done.set()
            if running:
                target.stop()
    return 0


def _drain(recorder: Recorder, done: threading.Event) -> None:
    while not done.wait(1.0):
        recorder.clear()  # peers' latencies are not reported; keep their memory flat


def _say(text: str) -> None:
    print(text, flush=True)


def main(argv: Sequence[str]) -> int:
    """Entry point of the child processes: ``direct BENCH_JSON OUT SETTINGS_JSON`` or ``peer SPEC_JSON``."""
    if argv[:1] == ["direct"] and len(argv) == 4:
        return _direct_main(json.loads(argv[1]), Path(argv[2]), json.loads(argv[3]))
    if argv[:1] == ["peer"] and len(argv) == 2:
        return _peer_main(json.loads(argv[1]))
    print("usage: python -m kiln.bench.compare direct BENCH_JSON OUT SETTINGS_JSON | peer SPEC_JSON", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
