"""Compiled load generators for the serving benchmarks, so that the client takes little of a small machine.

* ``wrk`` (Debian package ``wrk``) drives HTTP/1.1 POSTs, one request in flight per connection, from a Lua script
  that sets the body and headers and prints a JSON summary (count, errors, latency percentiles).
* ``h2load`` (Debian package ``nghttp2-client``) drives unary gRPC: the body is a gRPC length-prefixed message
  (1-byte compression flag + 4-byte big-endian length + serialized ``ModelInferRequest``), sent with
  ``content-type: application/grpc`` and ``te: trailers``; ``-m 1`` keeps one call in flight per connection.

h2load sees HTTP status 200 even when a call fails (gRPC puts failures in the trailers), so every run compares the
DATA bytes received with ``succeeded x size of the verified response``: a failed call carries no response message,
so a shortfall counts as errors. Only 127.0.0.1 is targeted, and every run is bounded by its duration plus a hard
timeout. :class:`CpuMeter` splits the cores used during a window between the server, the load generator and the
rest of the machine, so that a busy shared machine shows in the results instead of in the figures.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import _common  # noqa: F401  (puts this checkout's src/ first on sys.path)
import numpy as np
import numpy.typing as npt

from kiln.bench.resources import process_tree

GRPC_INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"
TOOLS = {"wrk": "wrk", "h2load": "nghttp2-client"}  # tool -> Debian package


def missing_tools(*tools: str) -> list[str]:
    """The Debian packages to install for the ``tools`` (names in :data:`TOOLS`) that are not on PATH."""
    return [TOOLS[tool] for tool in tools if shutil.which(tool) is None]


def require_tools(*tools: str) -> None:
    missing = missing_tools(*tools)
    if missing:
        raise SystemExit(f"missing load generators; install them with: apt-get install -y {' '.join(missing)}")


def tool_versions() -> dict[str, str]:
    return {tool: _tool_version([tool, "--version"]) for tool in TOOLS}


def _tool_version(cmd: list[str]) -> str:
    if shutil.which(cmd[0]) is None:
        return "missing"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    text = (proc.stdout + proc.stderr).strip().splitlines()
    return text[0] if text else "unknown"


@dataclasses.dataclass
class LoadResult:
    """One fixed measurement window. ``ok`` excludes failed requests; ``rps = ok / duration_s``."""

    tool: str
    concurrency: int
    duration_s: float
    ok: int
    errors: int
    rps: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    notes: str = ""
    # Average cores used during the window by the server's processes, by the load generator, and by everything
    # else on the machine (other users' processes; about 0 on a quiet machine).
    cpu_server: float | None = None
    cpu_loadgen: float | None = None
    cpu_other: float | None = None

    def line(self) -> str:
        extra = f"  [{self.notes}]" if self.notes else ""
        return (f"{self.rps:9,.0f} req/s  p50 {self.p50_ms:7.3f} ms  p99 {self.p99_ms:7.3f} ms  ok {self.ok:6d}  "
                f"errors {self.errors}  cpu server/loadgen/other {self.cpu_server or 0:.2f}/"
                f"{self.cpu_loadgen or 0:.2f}/{self.cpu_other or 0:.2f}{extra}")


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _machine_ticks() -> int:
    """Busy jiffies over all CPUs from /proc/stat."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9])
    return user + nice + system + irq + softirq + steal


def _tree_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds of the live processes among ``pids`` (and their descendants)."""
    total = 0
    for root in pids:
        for pid in process_tree(root):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            total += int(fields[11]) + int(fields[12])
    return total / _CLK_TCK


def _own_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _children_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class CpuMeter:
    """Cores used during a ``with`` block: the server's processes (``server_pids`` and their descendants, or this
    process when None), the load generators this process ran and reaped, and everything else."""

    def __init__(self, server_pids: Iterable[int] | None) -> None:
        self._pids = None if server_pids is None else list(server_pids)
        self.server = self.loadgen = self.machine = self.other = 0.0

    def _server_seconds(self) -> float:
        return _own_seconds() if self._pids is None else _tree_seconds(self._pids)

    def __enter__(self) -> CpuMeter:
        self._t0 = time.perf_counter()
        self._machine0 = _machine_ticks()
        self._server0 = self._server_seconds()
        self._children0 = _children_seconds()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        self.server = (self._server_seconds() - self._server0) / wall
        self.loadgen = (_children_seconds() - self._children0) / wall if self._pids is not None else 0.0
        self.machine = (_machine_ticks() - self._machine0) / _CLK_TCK / wall
        self.other = max(0.0, self.machine - self.server - self.loadgen)

    def apply(self, result: LoadResult) -> LoadResult:
        result.cpu_server, result.cpu_loadgen, result.cpu_other = self.server, self.loadgen, self.other
        if self.other > 0.25:
            note = f"machine not quiet: {self.other:.2f} cores used by other processes"
            result.notes = f"{result.notes}; {note}" if result.notes else note
        return result


def wait_quiet(server_pids: Iterable[int] | None, max_wait_s: float, threshold: float = 0.15,
               sample_s: float = 0.5) -> float | None:
    """Wait (up to ``max_wait_s``; 0 skips the check) until processes other than the server use < ``threshold``
    cores; return what they used in the last sample."""
    if max_wait_s <= 0:
        return None
    pids = None if server_pids is None else list(server_pids)
    deadline = time.monotonic() + max_wait_s
    announced = False
    while True:
        with CpuMeter(pids) as meter:
            time.sleep(sample_s)
        other = meter.machine - (meter.server if pids is not None else 0.0)
        if other < threshold or time.monotonic() >= deadline:
            return other
        if not announced:
            print(f"   waiting for a quiet machine (other processes use {other:.2f} cores) ...", flush=True)
            announced = True
        time.sleep(2.0)


_WRK_LUA = r"""
local f = assert(io.open(os.getenv("KILN_BENCH_BODY"), "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
local hf = assert(io.open(os.getenv("KILN_BENCH_HEADERS"), "rb"))
for line in hf:lines() do
  local k, v = line:match("^([^:]+):%s*(.*)$")
  if k then wrk.headers[k] = v end
end
hf:close()

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'KILN_WRK_JSON {"requests": %d, "duration_us": %d, "bytes": %d, "connect": %d, "read": %d, "write": %d, ' ..
    '"status": %d, "timeout": %d, "p50_us": %d, "p99_us": %d, "mean_us": %.1f, "max_us": %d}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99), latency.mean, latency.max))
end
"""


def run_wrk(url: str, body: bytes, headers: Mapping[str, str], concurrency: int, duration_s: float,
            warmup_s: float = 0.0, threads: int = 1, server_pids: Iterable[int] | None = None) -> LoadResult:
    """POST ``body`` to ``url`` from ``concurrency`` keep-alive connections for ``duration_s`` seconds, after a run
    of ``warmup_s`` seconds whose figures are dropped. wrk counts time in whole seconds (at least 1)."""
    if warmup_s > 0:
        run_wrk(url, body, headers, concurrency, warmup_s, threads=threads)
    with tempfile.TemporaryDirectory(prefix="kiln-wrk-") as tmp:
        body_path = Path(tmp, "body.bin")
        body_path.write_bytes(body)
        headers_path = Path(tmp, "headers.txt")
        headers_path.write_text("".join(f"{k}: {v}\n" for k, v in headers.items()))
        script = Path(tmp, "post.lua")
        script.write_text(_WRK_LUA)
        env = {**os.environ, "KILN_BENCH_BODY": str(body_path), "KILN_BENCH_HEADERS": str(headers_path)}
        threads = max(1, min(threads, concurrency))
        cmd = ["wrk", f"-t{threads}", f"-c{concurrency}", f"-d{_secs(duration_s)}", "--timeout", "10s",
               "-s", str(script), url]
        with CpuMeter(server_pids if server_pids is not None else []) as meter:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=duration_s + 60)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("KILN_WRK_JSON ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed (rc {proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
    s = json.loads(line.split(" ", 1)[1])
    errors = s["status"] + s["connect"] + s["read"] + s["write"] + s["timeout"]
    ok = max(0, s["requests"] - s["status"])
    duration = s["duration_us"] / 1e6
    notes = ""
    if errors:
        notes = (f"errors: status={s['status']} connect={s['connect']} read={s['read']} write={s['write']} "
                 f"timeout={s['timeout']}")
    result = LoadResult("wrk", concurrency, duration, ok, errors, ok / duration, s["p50_us"] / 1e3,
                        s["p99_us"] / 1e3, s["mean_us"] / 1e3, notes)
    return meter.apply(result)


def grpc_frame(message: bytes) -> bytes:
    """A gRPC length-prefixed message: compression flag 0, 4-byte big-endian length, the message."""
    return struct.pack(">BI", 0, len(message)) + message


GRPC_CONNECTIONS_HELP = ("HTTP/2 connections the gRPC calls share (default: one per call in flight; 1: one for all, "
                         "as perf_analyzer's and tritonclient's shared channel)")


def run_h2load(url: str, message: bytes, concurrency: int, duration_s: float, warmup_s: float,
               expected_response_bytes: int, server_pids: Iterable[int] | None = None,
               connections: int | None = None) -> LoadResult:
    """Unary gRPC calls of ``message`` (a serialized request) for about ``duration_s`` after ``warmup_s``,
    ``concurrency`` in flight over ``connections`` HTTP/2 connections (None: one each; 1: all on one, as
    perf_analyzer and tritonclient share one channel between their concurrent calls).

    h2load runs a fixed number of calls (``-n``) sized from the rate of a short probe and of the warm-up, not a
    timed run (``-D``): at the end of a timed run h2load resets the calls still in flight, i.e. the client cancels
    them, which measures the server's cancellation path rather than its throughput. Calls that never complete
    within the hard timeout count as errors.

    ``expected_response_bytes`` is the size of the verified response message; each successful call must receive
    exactly ``5 + expected_response_bytes`` DATA bytes. Warm-up and probe are separate h2load runs, so the DATA
    byte count of the measured run covers the measured calls only.
    """
    streams = _streams(concurrency, connections)
    probe = _h2load(url, message, streams, max(200, concurrency * 10), timeout_s=30 + duration_s)
    rate = probe.rate
    if warmup_s > 0 and rate > 0:
        warm = _h2load(url, message, streams, max(concurrency, round(rate * warmup_s)),
                       timeout_s=30 + 4 * warmup_s)
        rate = warm.rate or rate
    count = max(concurrency * 10, round(rate * duration_s))
    with CpuMeter(server_pids if server_pids is not None else []) as meter:
        run = _h2load(url, message, streams, count, timeout_s=30 + 4 * duration_s)
    return meter.apply(_h2load_result(run, concurrency, count, expected_response_bytes))


def _h2load_result(run: _H2Run, concurrency: int, count: int, expected_response_bytes: int) -> LoadResult:
    notes = []
    per_call = 5 + expected_response_bytes
    # Calls that returned 200 but carried no (or a different-size) response message are gRPC failures.
    short = max(0, round((run.succeeded * per_call - run.data_bytes) / per_call))
    if run.data_bytes != run.succeeded * per_call:
        notes.append(f"DATA bytes {run.data_bytes} != {run.succeeded} x {per_call}: ~{short} calls without a full "
                     f"response")
    if run.non200:
        notes.append(f"{run.non200} non-200 in log")
    ok = max(0, run.succeeded - short)
    errors = run.failed + short + max(0, count - run.done)
    if run.timed_out:
        notes.append(f"h2load timed out after {run.duration_s:.0f} s: {count - run.done} of {count} calls never "
                     f"completed")
    if ok == 0:
        errors = max(errors, 1)
        notes.append(f"no call completed; h2load said: {run.output[-600:]!r}")
    lat = run.latencies_us
    p50 = p99 = mean = float("nan")
    if lat.size:
        p50, p99, mean = (float(np.percentile(lat, 50)) / 1e3, float(np.percentile(lat, 99)) / 1e3,
                          float(lat.mean()) / 1e3)
    rps = ok / run.duration_s if run.duration_s else 0.0
    return LoadResult("h2load", concurrency, run.duration_s, ok, errors, rps, p50, p99, mean, "; ".join(notes))


@dataclasses.dataclass
class _H2Run:
    output: str
    duration_s: float
    done: int
    succeeded: int
    failed: int
    data_bytes: int
    latencies_us: npt.NDArray[np.float64]
    non200: int
    timed_out: bool

    @property
    def rate(self) -> float:
        return self.succeeded / self.duration_s if self.duration_s > 0 else 0.0


def _streams(concurrency: int, connections: int | None) -> tuple[int, int]:
    """h2load's clients (connections) and streams per client for ``concurrency`` calls in flight."""
    clients = concurrency if connections is None else connections
    if clients < 1 or concurrency % clients:
        raise ValueError(f"{concurrency} calls in flight cannot be spread evenly over {clients} connections")
    return clients, concurrency // clients


def _h2load(url: str, message: bytes, streams: tuple[int, int], count: int, timeout_s: float) -> _H2Run:
    with tempfile.TemporaryDirectory(prefix="kiln-h2load-") as tmp:
        body_path = Path(tmp, "body.bin")
        body_path.write_bytes(grpc_frame(message))
        log_path = Path(tmp, "requests.tsv")
        cmd = ["h2load", "-c", str(streams[0]), "-m", str(streams[1]), "-t", "1", "-n", str(count),
               "-d", str(body_path), "--log-file", str(log_path),
               "-H", "content-type: application/grpc", "-H", "te: trailers", url + GRPC_INFER_PATH]
        started = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            latencies_us, non200 = _h2load_log(log_path)
            out = _text(exc.stdout)
            return _H2Run(out, time.perf_counter() - started, int(latencies_us.size), int(latencies_us.size), 0, 0,
                          latencies_us, non200, True)
        if proc.returncode != 0:
            raise RuntimeError(f"h2load failed (rc {proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
        latencies_us, non200 = _h2load_log(log_path)
    return _parse_h2load(proc.stdout, latencies_us, non200)


def _text(output: Any) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else str(output or "")


def _parse_h2load(out: str, latencies_us: npt.NDArray[np.float64], non200: int) -> _H2Run:
    finished = re.search(r"finished in ([\d.]+)(m?s)", out)
    reqs = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
                     r"(\d+) errored, (\d+) timeout", out)
    data = re.search(r"\((\d+)\) data", out)
    if finished is None or reqs is None or data is None:
        raise RuntimeError(f"cannot parse h2load output:\n{out}")
    duration = float(finished.group(1)) / (1000.0 if finished.group(2) == "ms" else 1.0)
    failed = int(reqs.group(5)) + int(reqs.group(6)) + int(reqs.group(7))
    return _H2Run(out, duration, int(reqs.group(3)), int(reqs.group(4)), failed, int(data.group(1)), latencies_us,
                  non200, False)


def _h2load_log(path: Path) -> tuple[npt.NDArray[np.float64], int]:
    lat: list[int] = []
    non200 = 0
    if path.is_file():
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) < 3:
                continue
            if parts[1] != "200":
                non200 += 1
                continue
            lat.append(int(parts[2]))
    return np.asarray(lat, dtype=np.float64), non200


def _secs(seconds: float) -> str:
    return f"{max(1, round(seconds))}s"
