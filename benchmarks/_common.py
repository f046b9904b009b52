"""Shared pieces of the kiln benchmarks: machine description, load generators, payloads, server processes.

Load generators are compiled Debian tools so that the client takes as little of a 2-core machine as possible:

* ``wrk`` (package ``wrk``) drives HTTP/1.1 POSTs, one request in flight per connection, from a Lua script
  that sets the body and headers and prints a JSON summary (count, errors, latency percentiles).
* ``h2load`` (package ``nghttp2-client``) drives unary gRPC: the body is a gRPC length-prefixed message (1-byte
  compression flag + 4-byte big-endian length + serialized ``ModelInferRequest``), sent with
  ``content-type: application/grpc`` and ``te: trailers``; ``-m 1`` keeps one call in flight per connection.
  Runs are sized in calls (``-n``, from a probe of the rate) to last about the requested window, so that no
  call is cut off by the client at the end (see ``run_h2load``).
  h2load sees HTTP status 200 even when a call fails (gRPC puts failures in the trailers), so every run also
  compares the DATA bytes received with ``succeeded x size of the verified response``: a failed call carries
  no response message, so any shortfall is counted as errors and the run is flagged.

``ensure_tools()`` installs both with apt-get when they are missing (needs root and the Debian mirror).
Only 127.0.0.1 is ever targeted, and every load run is bounded by its duration (plus a hard timeout).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import http.client
import importlib.metadata
import json
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

HOST = "127.0.0.1"
BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
PROJECT_PYTHON = REPO_ROOT / ".venv" / "bin" / "python"
GRPC_INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"
SRC = REPO_ROOT / "src"

_PACKAGES = ("numpy", "onnxruntime", "starlette", "uvicorn", "uvloop", "httptools", "grpcio", "protobuf",
             "prometheus-client")

# kiln need not be pip-installed into the venv (src layout): this checkout's src/ is always used, in this process
# and (through PYTHONPATH) in the servers it starts.
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))


def project_env() -> dict[str, str]:
    """The environment for project-venv subprocesses: this checkout's ``src`` first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    return env


# --------------------------------------------------------------------------------------------------------------
# Machine description and output helpers


def machine_info(extra_packages: Mapping[str, str] | None = None) -> dict[str, Any]:
    """nproc, CPU model, kernel, Python and package versions, load generator versions."""
    cpu_model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    try:
        nproc = int(subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError, ValueError):
        nproc = os.cpu_count() or 0
    mem_total = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_total = line.split(":", 1)[1].strip()
                break
    packages: dict[str, str] = {}
    for name in _PACKAGES:
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            packages[name] = "not installed"
    with contextlib.suppress(ImportError):
        import kiln

        packages["kiln"] = f"{kiln.__version__} ({Path(kiln.__file__).parent})"
    packages.update(extra_packages or {})
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "nproc": nproc,
        "cpu_model": cpu_model,
        "mem_total": mem_total,
        "kernel": platform.release(),
        "os": _os_name(),
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "packages": packages,
        "tools": {"wrk": _tool_version(["wrk", "--version"]), "h2load": _tool_version(["h2load", "--version"])},
    }


def _os_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    return platform.platform()


def _tool_version(cmd: list[str]) -> str:
    if shutil.which(cmd[0]) is None:
        return "missing"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    text = (proc.stdout + proc.stderr).strip().splitlines()
    return text[0] if text else "unknown"


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])


def header_lines(title: str, info: Mapping[str, Any]) -> list[str]:
    pkgs = ", ".join(f"{k} {v}" for k, v in info["packages"].items())
    tools = ", ".join(f"{v}" for v in info["tools"].values())
    return [
        f"# {title}",
        f"command: {info['command']}",
        f"date:    {info['date']}",
        f"machine: nproc={info['nproc']}, CPU '{info['cpu_model']}', memory {info['mem_total']}, "
        f"{info['os']}, kernel {info['kernel']}",
        f"python:  {info['python']} ({info['python_executable']})",
        f"packages: {pkgs}",
        f"load generators: {tools}",
    ]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    cells = [[str(h) for h in headers]] + [[_cell(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = []
    for n, row in enumerate(cells):
        line = "  ".join(c.rjust(w) if n and _numeric(c) else c.ljust(w) for c, w in zip(row, widths, strict=True))
        out.append(line.rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value >= 100:
            return f"{value:,.0f}"
        if value >= 10:
            return f"{value:.1f}"
        if value >= 1:
            return f"{value:.2f}"
        return f"{value:.3f}"
    return str(value)


def _numeric(text: str) -> bool:
    return bool(re.fullmatch(r"[-+]?[\d,]*\.?\d+x?", text))


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")


def _json_default(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value)}")


# --------------------------------------------------------------------------------------------------------------
# Load generators


def ensure_tools() -> None:
    """Install wrk and h2load from Debian when missing (``apt-get install wrk nghttp2-client``)."""
    missing = [pkg for tool, pkg in (("wrk", "wrk"), ("h2load", "nghttp2-client")) if shutil.which(tool) is None]
    if not missing:
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise SystemExit(f"missing load generators; install them first: apt-get install -y {' '.join(missing)}")
    print(f"installing {' '.join(missing)} with apt-get ...", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL, timeout=600)
    subprocess.run(["apt-get", "install", "-y", "-q", *missing], check=True, env=env, stdout=subprocess.DEVNULL,
                   timeout=600)


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
    # Average CPU cores used during the window by the server's process group, by the load generator, and by
    # everything else on the machine (other users' processes; should be ~0 on a quiet machine).
    cpu_server: float | None = None
    cpu_loadgen: float | None = None
    cpu_other: float | None = None


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def _group_ticks(pgids: Sequence[int]) -> int:
    """utime + stime jiffies of every live process in the process groups ``pgids``."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            rest = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(rest[2]) in pgids:
            total += int(rest[11]) + int(rest[12])
    return total


class CpuMeter:
    """CPU use split into server / load generator (this process's reaped children) / everything else.

    ``server_pgid`` is the server's process group (or several); ``None`` means the server is this very process
    (direct mode).
    """

    def __init__(self, server_pgid: int | Sequence[int] | None) -> None:
        self.pgid = server_pgid
        self._pgids = [server_pgid] if isinstance(server_pgid, int) else list(server_pgid or [])

    def _server_seconds(self) -> float:
        if self.pgid is None:
            r = resource.getrusage(resource.RUSAGE_SELF)
            return r.ru_utime + r.ru_stime
        return _group_ticks(self._pgids) / _CLK_TCK

    def __enter__(self) -> CpuMeter:
        self.t0 = time.perf_counter()
        self.machine0 = _machine_ticks()
        self.server0 = self._server_seconds()
        c = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.children0 = c.ru_utime + c.ru_stime
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self.t0
        busy1, _total1 = _machine_ticks()
        c = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.server = (self._server_seconds() - self.server0) / wall
        self.loadgen = (c.ru_utime + c.ru_stime - self.children0) / wall if self.pgid is not None else 0.0
        self.machine = (busy1 - self.machine0[0]) / _CLK_TCK / wall
        self.other = max(0.0, self.machine - self.server - self.loadgen)

    def apply(self, result: LoadResult) -> LoadResult:
        result.cpu_server, result.cpu_loadgen, result.cpu_other = self.server, self.loadgen, self.other
        if self.other > 0.25:
            note = f"machine not quiet: {self.other:.2f} cores used by other processes"
            result.notes = f"{result.notes}; {note}" if result.notes else note
        return result


def wait_quiet(server_pgid: int | Sequence[int] | None, max_wait_s: float, threshold: float = 0.15,
               sample_s: float = 0.5) -> float:
    """Wait (up to ``max_wait_s``) until processes other than the server use < ``threshold`` cores; return that."""
    deadline = time.monotonic() + max_wait_s
    announced = False
    while True:
        with CpuMeter(server_pgid) as meter:
            time.sleep(sample_s)
        other = meter.machine - (meter.server if server_pgid is not None else 0.0)
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
            threads: int = 1, server_pgid: int | Sequence[int] | None = None) -> LoadResult:
    """POST ``body`` to ``url`` from ``concurrency`` keep-alive connections for ``duration_s`` seconds."""
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
        with CpuMeter(server_pgid if server_pgid is not None else -1) as meter:
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


def run_h2load(url: str, message: bytes, concurrency: int, duration_s: float, warmup_s: float,
               expected_response_bytes: int, server_pgid: int | Sequence[int] | None = None) -> LoadResult:
    """Unary gRPC calls of ``message`` (a serialized request) for about ``duration_s`` after ``warmup_s``.

    h2load runs with a fixed number of calls (``-n``) sized from the rate of a short probe and of the warm-up,
    not with ``-D``: at the end of a timed run h2load resets the calls still in flight, i.e. the client cancels
    them, which exercises the server's cancellation path rather than its throughput (it once killed kiln's
    dynamic batcher worker, so every later call hung; see README). Every run is bounded by a hard timeout;
    calls that never complete count as errors.

    ``expected_response_bytes`` is the size of the verified response message; each successful call must
    receive exactly ``5 + expected_response_bytes`` DATA bytes. Warm-up and probe are separate h2load runs,
    so the DATA byte count of the measured run covers the measured calls only.
    """
    probe = _h2load(url, message, concurrency, max(200, concurrency * 10), timeout_s=30 + duration_s)
    rate = probe.rate
    if warmup_s > 0 and rate > 0:
        warm = _h2load(url, message, concurrency, max(concurrency, round(rate * warmup_s)),
                       timeout_s=30 + 4 * warmup_s)
        rate = warm.rate or rate
    count = max(concurrency * 10, round(rate * duration_s))
    with CpuMeter(server_pgid if server_pgid is not None else -1) as meter:
        run = _h2load(url, message, concurrency, count, timeout_s=30 + 4 * duration_s)
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
    if lat.size:
        p50, p99, mean = (float(np.percentile(lat, 50)) / 1e3, float(np.percentile(lat, 99)) / 1e3,
                          float(lat.mean()) / 1e3)
    else:
        p50 = p99 = mean = float("nan")
    result = LoadResult("h2load", concurrency, run.duration_s, ok, errors, ok / run.duration_s if run.duration_s else 0,
                        p50, p99, mean, "; ".join(notes))
    return meter.apply(result)


@dataclasses.dataclass
class _H2Run:
    output: str
    duration_s: float
    done: int
    succeeded: int
    failed: int
    data_bytes: int
    latencies_us: np.ndarray
    non200: int
    timed_out: bool

    @property
    def rate(self) -> float:
        return self.succeeded / self.duration_s if self.duration_s > 0 else 0.0


def _h2load(url: str, message: bytes, concurrency: int, count: int, timeout_s: float) -> _H2Run:
    with tempfile.TemporaryDirectory(prefix="kiln-h2load-") as tmp:
        body_path = Path(tmp, "body.bin")
        body_path.write_bytes(grpc_frame(message))
        log_path = Path(tmp, "requests.tsv")
        cmd = ["h2load", "-c", str(concurrency), "-m", "1", "-t", "1", "-n", str(count),
               "-d", str(body_path), "--log-file", str(log_path),
               "-H", "content-type: application/grpc", "-H", "te: trailers", url + GRPC_INFER_PATH]
        started = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            latencies_us, non200 = _h2load_log(log_path)
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            return _H2Run(out, time.perf_counter() - started, int(latencies_us.size), int(latencies_us.size), 0, 0,
                          latencies_us, non200, True)
        if proc.returncode != 0:
            raise RuntimeError(f"h2load failed (rc {proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
        latencies_us, non200 = _h2load_log(log_path)
    out = proc.stdout
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


def _h2load_log(path: Path) -> tuple[np.ndarray, int]:
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
    return f"{seconds:g}s" if seconds >= 1 else f"{int(seconds * 1000)}ms"


# --------------------------------------------------------------------------------------------------------------
# V2 payloads


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str
    array: np.ndarray


_NP = {"INT32": np.int32, "FP32": np.float32, "INT64": np.int64, "FP64": np.float64}


def json_body(inputs: Sequence[Tensor]) -> bytes:
    """A KServe V2 JSON request with all tensors as flat ``data`` lists (no ``outputs``: all are returned)."""
    return json.dumps({"inputs": [{"name": t.name, "shape": list(t.array.shape), "datatype": t.datatype,
                                   "data": t.array.reshape(-1).tolist()} for t in inputs]}).encode()


def binary_body(inputs: Sequence[Tensor], outputs: Sequence[str]) -> tuple[bytes, dict[str, str]]:
    """A request in the binary tensor data extension: JSON header, then the raw input bytes; binary outputs."""
    header = {
        "inputs": [{"name": t.name, "shape": list(t.array.shape), "datatype": t.datatype,
                    "parameters": {"binary_data_size": t.array.nbytes}} for t in inputs],
        "outputs": [{"name": n, "parameters": {"binary_data": True}} for n in outputs],
    }
    head = json.dumps(header).encode()
    body = head + b"".join(np.ascontiguousarray(t.array).tobytes() for t in inputs)
    return body, {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))}


def parse_json_response(body: bytes) -> dict[str, np.ndarray]:
    doc = json.loads(body)
    return {o["name"]: np.asarray(o["data"], dtype=_NP[o["datatype"]]).reshape(o["shape"]) for o in doc["outputs"]}


def parse_binary_response(body: bytes, header_length: int | None) -> dict[str, np.ndarray]:
    if header_length is None:
        return parse_json_response(body)
    doc = json.loads(body[:header_length])
    offset = header_length
    out: dict[str, np.ndarray] = {}
    for o in doc["outputs"]:
        dtype = _NP[o["datatype"]]
        size = (o.get("parameters") or {}).get("binary_data_size")
        if size is None:
            out[o["name"]] = np.asarray(o["data"], dtype=dtype).reshape(o["shape"])
            continue
        out[o["name"]] = np.frombuffer(body[offset:offset + size], dtype=dtype).reshape(o["shape"])
        offset += size
    if offset != len(body):
        raise ValueError(f"binary response has {len(body) - offset} trailing bytes")
    return out


def _grpc_pb() -> Any:
    # The official client's messages (an independent copy of the protocol from kiln's own).
    from tritonclient.grpc import service_pb2

    return service_pb2


def grpc_request(model: str, inputs: Sequence[Tensor]) -> bytes:
    """A serialized ModelInferRequest carrying every input in ``raw_input_contents`` (all outputs requested)."""
    pb = _grpc_pb()
    req = pb.ModelInferRequest(model_name=model)
    for t in inputs:
        req.inputs.add(name=t.name, datatype=t.datatype, shape=list(t.array.shape))
        req.raw_input_contents.append(np.ascontiguousarray(t.array).tobytes())
    data: bytes = req.SerializeToString()
    return data


def parse_grpc_response(data: bytes) -> dict[str, np.ndarray]:
    pb = _grpc_pb()
    resp = pb.ModelInferResponse.FromString(data)
    out: dict[str, np.ndarray] = {}
    for i, o in enumerate(resp.outputs):
        dtype = _NP[o.datatype]
        if resp.raw_output_contents:
            arr = np.frombuffer(resp.raw_output_contents[i], dtype=dtype)
        elif o.datatype == "FP32":
            arr = np.asarray(o.contents.fp32_contents, dtype=dtype)
        else:
            arr = np.asarray(o.contents.int_contents, dtype=dtype)
        out[o.name] = arr.reshape(list(o.shape))
    return out


def grpc_unary(port: int, path: str, message: bytes, timeout: float = 10.0) -> bytes:
    """Send already-serialized bytes to a unary method and return the serialized response (grpcio client)."""
    import grpc

    with grpc.insecure_channel(f"{HOST}:{port}") as channel:
        call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
        data: bytes = call(message, timeout=timeout)
        return data


def http_post(port: int, path: str, body: bytes, headers: Mapping[str, str],
              timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers=dict(headers))
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def http_get_status(port: int, path: str, timeout: float = 1.0) -> int | None:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except OSError:
        return None
    finally:
        conn.close()


def check_outputs(got: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray], what: str) -> None:
    """Raise AssertionError unless ``got`` has exactly the expected outputs, shapes, dtypes and values."""
    if set(got) != set(expected):
        raise AssertionError(f"{what}: outputs {sorted(got)} != expected {sorted(expected)}")
    for name, want in expected.items():
        have = got[name]
        if tuple(have.shape) != tuple(want.shape) or have.dtype != want.dtype:
            raise AssertionError(f"{what}: {name} is {have.dtype}{list(have.shape)}, expected {want.dtype}"
                                 f"{list(want.shape)}")
        if want.dtype.kind == "f":
            ok = np.allclose(have, want, rtol=1e-4, atol=1e-5)
        else:
            ok = np.array_equal(have, want)
        if not ok:
            raise AssertionError(f"{what}: {name} differs from the reference (max abs diff "
                                 f"{float(np.max(np.abs(have.astype(np.float64) - want))):.3g})")


# --------------------------------------------------------------------------------------------------------------
# Reference models (computed independently of kiln and onnxruntime)


def simple_case() -> tuple[list[Tensor], dict[str, np.ndarray]]:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    return [Tensor("INPUT0", "INT32", a), Tensor("INPUT1", "INT32", b)], {"OUTPUT0": a + b, "OUTPUT1": a - b}


def mlp_case(model_onnx: Path) -> tuple[list[Tensor], dict[str, np.ndarray]]:
    """One FP32 row and its logits computed with numpy from the ONNX initializers (Gemm transB=1 + ReLU)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(model_onnx))
    weights = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    x = np.random.default_rng(1234).standard_normal((1, 64)).astype(np.float32)
    h = x.astype(np.float64)
    layers = sorted({n.split(".")[0] for n in weights}, key=lambda s: int(s[2:]))
    for i, layer in enumerate(layers):
        h = h @ weights[f"{layer}.weight"].astype(np.float64).T + weights[f"{layer}.bias"]
        if i != len(layers) - 1:
            h = np.maximum(h, 0.0)
    return [Tensor("INPUT0", "FP32", x)], {"OUTPUT0": h.astype(np.float32)}


def model_case(repo: Path, model: str) -> tuple[list[Tensor], dict[str, np.ndarray]]:
    if model == "simple":
        return simple_case()
    if model == "mlp":
        return mlp_case(repo / "mlp" / "1" / "model.onnx")
    raise SystemExit(f"unknown model '{model}' (expected simple or mlp)")


def build_demo_repo(path: Path) -> None:
    """``kiln demo-repo PATH`` (simple and mlp; no resnet50) with the project's venv."""
    subprocess.run([str(PROJECT_PYTHON), "-m", "kiln.cli", "demo-repo", str(path)], check=True,
                   stdout=subprocess.DEVNULL, timeout=300, env=project_env())


# --------------------------------------------------------------------------------------------------------------
# Server processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


class ServerProcess:
    """A server subprocess in its own process group (so its workers stop with it); output goes to a log file."""

    def __init__(self, name: str, cmd: Sequence[str], log_path: Path, cwd: Path | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.log_path = log_path
        self._log = open(log_path, "wb")  # closed in stop()
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd,
                                     env=dict(env) if env is not None else None, start_new_session=True)

    def wait_http_ready(self, port: int, paths: Sequence[str] = ("/v2/health/ready",), timeout: float = 120.0,
                        interval: float = 0.05) -> float:
        """Seconds from spawn until every path answered 200."""
        deadline = time.monotonic() + timeout
        pending = list(paths)
        while pending:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            if http_get_status(port, pending[0]) == 200:
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s; log:\n{self.log_tail()}")
            time.sleep(interval)
        return time.perf_counter() - self.started

    def log_tail(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        return ""

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the process group, then SIGKILL it if it is still there after ``timeout`` seconds."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # Workers left in the group (e.g. MLServer's inference pool) go too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


@contextlib.contextmanager
def running(server: ServerProcess) -> Iterator[ServerProcess]:
    try:
        yield server
    finally:
        server.stop()


def kiln_serve_cmd(repo: Path, http_port: int, grpc_port: int, metrics_port: int) -> list[str]:
    return [str(PROJECT_PYTHON), "-m", "kiln.cli", "serve", "--model-repository", str(repo),
            "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port)]


def kiln_serve_available() -> tuple[bool, str]:
    """Whether ``kiln serve`` has the HTTP frontend and the port options (it is being written concurrently)."""
    if not (REPO_ROOT / "src" / "kiln" / "frontends" / "http" / "app.py").is_file():
        return False, "src/kiln/frontends/http/app.py does not exist yet"
    proc = subprocess.run([str(PROJECT_PYTHON), "-m", "kiln.cli", "serve", "--help"], capture_output=True,
                          text=True, timeout=60, env=project_env())
    if "--http-port" not in proc.stdout:
        return False, "`kiln serve --help` does not list --http-port"
    return True, ""
