"""NVIDIA's perf_analyzer as kiln bench's load generator for the http and grpc targets (``--load-generator
perf_analyzer``): each load level is one perf_analyzer run, and its CSV becomes the level's LevelResult.

kiln's own generator is a Python client, so the load it can offer is bounded by one core's worth of Python;
perf_analyzer is Triton's C++ client, so served figures are not. The target still opens the server (starting
``kiln serve`` when no URL is given), sends the check request and names the process whose memory is sampled; only
the load comes from perf_analyzer.

What comes from perf_analyzer: throughput, average and p50/p90/p95/p99 latency, client send and recv, and the
server's queue and compute phases (it reads the statistics extension itself), all from its ``-f`` CSV with
``--verbose-csv``; the request count from its summary; the number of windows ("Pass [n]" lines with ``-v``) and,
stamped as those lines arrive, when the merged windows ran. perf_analyzer writes no CSV for a level that does not
stabilize (exit status 2): the level is then run once more with the stability rule relaxed, so its figures are
those of three real windows, and it is reported with ``stable: false``.

perf_analyzer's memory grows with every request it sends (about the size of a request's input, per request, in
perf_analyzer 2.60; upstream perf_analyzer issue 84), so a long level at thousands of requests/s can take the
machine's memory, and the kernel's OOM killer then picks a process: perf_analyzer, or the server under test. Each
run is watched, and stopped once it holds more than half the memory that was available when it started. The level
is then measured once more over three windows half as long, without the stability rule (fewer requests sent, and
perf_analyzer's time between windows grows with what it holds), and reported with ``stable: false``; stopped again,
the windows are halved again, down to SHORTEST_WINDOW_MS, where a stop is an error that says why.
"""

from __future__ import annotations

import contextlib
import csv
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.bench.measure import MemoryMeter
from kiln.bench.options import BenchOptions
from kiln.bench.progress import Progress
from kiln.bench.records import Level
from kiln.bench.resources import MemoryFigures, rss_reader
from kiln.bench.result import ClientTimesMs, Latency, LevelResult, ServerTimesUs
from kiln.bench.targets.remote import split_url
from kiln.errors import UnavailableError

NAME = "perf_analyzer"
ENV = "KILN_PERF_ANALYZER"
INSTALL = "pip install perf-analyzer (the wheel ships the binary, which needs glibc >= 2.38)"
UNSTABLE_EXIT = 2
UNSTABLE_TEXT = "Failed to obtain stable measurement"
MERGED_WINDOWS = 3  # perf_analyzer reports the last 3 windows of a level merged
RELAXED_STABILITY = 999  # the rerun of an unstable level: any 3 windows with requests count
PASS_LINE = re.compile(r"^\s*Pass \[(\d+)\] throughput:")
REQUEST_COUNT = re.compile(r"^\s*Request count: (\d+)")
OUTPUT_TAIL_CHARS = 3000
SHORTEST_WINDOW_MS = 250  # the rerun of a level stopped for its memory halves the windows, down to this
RUN_TIMEOUT_MARGIN_S = 120.0  # beyond the longest a level can take (max_trials windows)
MEMORY_POLL_S = 0.5
MEMORY_SHARE = 0.5  # of the memory available when a run starts
LEAK_NOTE = ("perf_analyzer's memory grows with every request it sends (upstream perf_analyzer issue 84); use a "
             "shorter --measurement-interval or fewer --max-trials")


class PerfAnalyzerError(UnavailableError):
    """perf_analyzer is missing, or a run failed for another reason than an unstable measurement."""


class MemoryStopped(PerfAnalyzerError):
    """A run was stopped because perf_analyzer's memory outgrew the guard; ``held`` says how much it held."""

    def __init__(self, message: str, held: str) -> None:
        super().__init__(message)
        self.held = held


def shorter_window(window_ms: int) -> int | None:
    """The window to measure over after a run stopped for perf_analyzer's memory: half as long, not below
    ``SHORTEST_WINDOW_MS``; None once it was that short already."""
    return None if window_ms <= SHORTEST_WINDOW_MS else max(SHORTEST_WINDOW_MS, window_ms // 2)


def find_binary(configured: str | None) -> str:
    """The perf_analyzer to run: ``--perf-analyzer``, else ``$KILN_PERF_ANALYZER``, else ``perf_analyzer`` on
    PATH; PerfAnalyzerError naming the flag and the install when none is executable."""
    candidate = configured or os.environ.get(ENV) or NAME
    found = shutil.which(candidate)
    if found is None:
        raise PerfAnalyzerError(f"--load-generator perf_analyzer: no executable perf_analyzer at '{candidate}'; "
                                f"give its path with --perf-analyzer PATH (or ${ENV}), or install it: {INSTALL}")
    return found


def command(binary: str, options: BenchOptions, url: str, level: Level, csv_path: Path,
            stability_percentage: float | None = None, max_trials: int | None = None,
            measurement_interval_ms: int | None = None) -> list[str]:
    """The perf_analyzer command line for one level of ``options`` against the server at ``url`` (host:port)."""
    words = [binary, "-m", options.model, "-u", url, "-i", options.target, "-b", str(options.batch_size),
             "--measurement-interval", str(measurement_interval_ms or options.measurement_interval_ms),
             "--stability-percentage", f"{stability_percentage or options.stability_percentage:g}",
             "--max-trials", str(max_trials or options.max_trials),
             "--input-data", options.input_data, "-v", "-f", str(csv_path), "--verbose-csv"]
    if options.model_version:
        words += ["-x", options.model_version]
    if level.concurrency is not None:
        words += ["--concurrency-range", f"{level.concurrency}:{level.concurrency}"]
    else:
        words += ["--request-rate-range", f"{level.request_rate:g}:{level.request_rate:g}",
                  "--request-distribution", level.distribution]
    for name, dims in options.shapes.items():
        words += ["--shape", f"{name}:{','.join(map(str, dims))}"]
    if options.target == "http":
        words += ["--input-tensor-format", options.input_tensor_format,
                  "--output-tensor-format", options.output_tensor_format]
    if options.shared_memory != "none":
        words += ["--shared-memory", options.shared_memory,
                  "--output-shared-memory-size", str(options.output_shared_memory_size)]
    return words


@dataclass
class Output:
    """What one run printed, each "Pass [n]" line stamped with ``time.monotonic_ns`` as it arrived."""

    lines: list[str] = field(default_factory=list)
    pass_ns: list[int] = field(default_factory=list)
    started_ns: int = 0

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def request_count(self) -> int:
        counts = [int(m.group(1)) for m in map(REQUEST_COUNT.match, self.lines) if m]
        return counts[-1] if counts else 0

    def span_ns(self) -> tuple[int, int] | None:
        """When the merged windows ran: from the end of the window before them (or the run's start) to the end of
        the last one."""
        if not self.pass_ns:
            return None
        before = self.pass_ns[:-MERGED_WINDOWS]
        return (before[-1] if before else self.started_ns, self.pass_ns[-1])


def level_result(row: dict[str, str], level: Level, batch_size: int, *, requests: int, windows: int, stable: bool,
                 memory: MemoryFigures, span_ns: tuple[int, int] | None) -> LevelResult:
    """A row of perf_analyzer's ``--verbose-csv`` file (times in microseconds, Inferences/Second counting batch
    items) as the LevelResult kiln's own generator fills."""
    items_per_s = _number(row, "Inferences/Second")
    rate = items_per_s / batch_size
    latency = Latency(avg=_number(row, "Avg latency") / 1000, p50=_number(row, "p50 latency") / 1000,
                      p90=_number(row, "p90 latency") / 1000, p95=_number(row, "p95 latency") / 1000,
                      p99=_number(row, "p99 latency") / 1000)
    client = ClientTimesMs(send=_number(row, "Client Send") / 1000, recv=_number(row, "Client Recv") / 1000)
    server = ServerTimesUs(queue=_number(row, "Server Queue"), compute_input=_number(row, "Server Compute Input"),
                           compute_infer=_number(row, "Server Compute Infer"),
                           compute_output=_number(row, "Server Compute Output"))
    return LevelResult(concurrency=level.concurrency, request_rate=level.request_rate, throughput_infer_per_s=rate,
                       throughput_items_per_s=items_per_s, latency_ms=latency, client_ms=client, server_us=server,
                       stable=stable, windows=windows, errors=0, memory_mb=memory, requests=requests,
                       duration_s=requests / rate if rate > 0 else 0.0, window_span_ns=span_ns,
                       load_generator=NAME)


def read_row(path: Path) -> dict[str, str]:
    """The one row perf_analyzer's CSV holds for a single-level run."""
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise PerfAnalyzerError(f"perf_analyzer wrote no result row into {path}")
    return rows[0]


def _number(row: dict[str, str], column: str) -> float:
    value = row.get(column)
    if value is None or value == "":
        raise PerfAnalyzerError(f"perf_analyzer's CSV has no '{column}' column (columns: {', '.join(row)}); "
                                f"kiln bench reads the file written with --verbose-csv")
    try:
        return float(value)
    except ValueError:
        raise PerfAnalyzerError(f"perf_analyzer's CSV column '{column}' holds '{value}', not a number") from None


class PerfAnalyzerLoad:
    """Runs each level of ``options`` as one perf_analyzer run against the server at ``url``."""

    def __init__(self, binary: str, options: BenchOptions, url: str, memory_limit_bytes: int | None = None) -> None:
        self.binary = binary
        self.options = options
        self.memory_limit_bytes = memory_limit_bytes  # None: MEMORY_SHARE of what is available as each run starts
        host, port = split_url(url, 8000 if options.target == "http" else 8001)
        self.url = f"{host}:{port}"

    def measure(self, level: Level, memory: MemoryMeter, progress: Progress) -> LevelResult:
        progress.note(f"perf_analyzer: {level.describe()}")
        with tempfile.TemporaryDirectory(prefix="kiln-bench-pa-") as folder:
            path = Path(folder) / "level.csv"
            memory.start_level()
            try:
                words, output, code, stable, windows = self._level_runs(level, path, progress)
            finally:
                figures = memory.stop_level()
            if code != 0:
                killed = (" It was killed (SIGKILL), most likely by the kernel's OOM killer: " + LEAK_NOTE + "."
                          if code == -signal.SIGKILL else "")
                raise PerfAnalyzerError(f"perf_analyzer failed (exit status {code}) on model '{self.options.model}' "
                                        f"at {level.describe()}.{killed} {' '.join(words)}\n"
                                        f"{output.text[-OUTPUT_TAIL_CHARS:]}")
            return level_result(read_row(path), level, self.options.batch_size, requests=output.request_count(),
                                windows=windows, stable=stable, memory=figures, span_ns=output.span_ns())

    def _level_runs(self, level: Level, path: Path, progress: Progress) -> tuple[list[str], Output, int, bool, int]:
        """The level's last run (command, output, exit status), whether it was stable, and its windows (the first
        run's, unless that was stopped for its memory). Runs: as configured; once more without the stability rule
        if it did not stabilize; with windows half as long, and again, while perf_analyzer outgrows its memory guard."""
        words = command(self.binary, self.options, self.url, level, path)
        try:
            output, code = self._run(words)
            if code == UNSTABLE_EXIT and UNSTABLE_TEXT in output.text:
                windows = len(output.pass_ns)
                progress.note(f"perf_analyzer: {level.describe()} did not stabilize within "
                              f"{self.options.max_trials} windows; measuring 3 windows without the stability rule")
                words = command(self.binary, self.options, self.url, level, path, RELAXED_STABILITY, MERGED_WINDOWS)
                output, code = self._run(words)
                return words, output, code, False, windows
            return words, output, code, True, len(output.pass_ns)
        except MemoryStopped as stopped:
            interval = shorter_window(self.options.measurement_interval_ms) or SHORTEST_WINDOW_MS
            while True:  # halve the windows until a run fits; stopped at the shortest, the error reaches the caller
                progress.note(f"perf_analyzer: {level.describe()}: {stopped.held}; measuring 3 windows of {interval} "
                              f"ms without the stability rule")
                words = command(self.binary, self.options, self.url, level, path, RELAXED_STABILITY, MERGED_WINDOWS,
                                interval)
                try:
                    output, code = self._run(words)
                except MemoryStopped as again:
                    shorter = shorter_window(interval)
                    if shorter is None:
                        raise
                    interval, stopped = shorter, again
                    continue
                return words, output, code, False, len(output.pass_ns)

    def _run(self, words: Sequence[str]) -> tuple[Output, int]:
        output = Output(started_ns=time.monotonic_ns())
        try:
            process = subprocess.Popen(list(words), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       bufsize=1)
        except OSError as exc:
            raise PerfAnalyzerError(f"--perf-analyzer {self.binary} could not be started ({exc}); install it: "
                                    f"{INSTALL}") from None
        reader = threading.Thread(target=_read_lines, args=(process, output), daemon=True)
        reader.start()
        try:
            code = wait_watched(process, self._timeout_s(), self.memory_limit_bytes, self.options.model,
                                lambda: f"{' '.join(words)}\n{output.text[-OUTPUT_TAIL_CHARS:]}")
        except PerfAnalyzerError:
            process.kill()
            process.wait()
            reader.join()
            raise
        finally:
            if process.poll() is None:  # interrupted (Ctrl-C): leave no perf_analyzer behind
                process.kill()
                process.wait()
        reader.join()
        return output, code

    def _timeout_s(self) -> float:
        # A window that counts too few requests is lengthened by perf_analyzer, so allow twice the nominal time.
        return 2 * self.options.max_trials * self.options.measurement_interval_ms / 1000 + RUN_TIMEOUT_MARGIN_S


def wait_watched(process: subprocess.Popen[Any], timeout_s: float, memory_limit_bytes: int | None, model: str,
                 context: Callable[[], str]) -> int:
    """A perf_analyzer run's exit status; PerfAnalyzerError (the caller kills it) once it runs past ``timeout_s``
    or holds more than ``memory_limit_bytes`` (None: MEMORY_SHARE of what is available now). ``context`` gives
    the command and output to quote."""
    deadline = time.monotonic() + timeout_s
    limit = memory_limit_bytes or _available_share()
    held_now = rss_reader(process.pid) if limit is not None else None
    why = "" if memory_limit_bytes else f" ({MEMORY_SHARE:.0%} of what was available when it started)"
    while True:
        try:
            return process.wait(timeout=MEMORY_POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() >= deadline:
            raise PerfAnalyzerError(f"perf_analyzer did not finish within {timeout_s:.0f} s: {context()}")
        held = held_now() if held_now is not None else None
        if limit is not None and held is not None and held > limit:
            raise MemoryStopped(f"perf_analyzer was stopped holding {held / 2**30:.1f} GiB of memory, more than "
                                f"the {limit / 2**30:.1f} GiB allowed{why}, on model '{model}': {LEAK_NOTE}. "
                                f"{context()}", held=f"stopped holding {held / 2**30:.1f} GiB")


def _read_lines(process: subprocess.Popen[str], output: Output) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        if PASS_LINE.match(line):
            output.pass_ns.append(time.monotonic_ns())
        output.lines.append(line.rstrip("\n"))
    process.stdout.close()


def _available_share() -> int | None:
    """MEMORY_SHARE of the memory available now; None without psutil (the run is then not watched)."""
    with contextlib.suppress(ImportError):
        import psutil

        return int(psutil.virtual_memory().available * MEMORY_SHARE)
    return None
