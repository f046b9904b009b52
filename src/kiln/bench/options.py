"""What a bench run measures, and the parsers for the range and shape arguments (perf_analyzer's spellings)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln._flags import flag
from kiln.errors import InvalidArgumentError

TARGETS = ("direct", "inprocess", "http", "grpc")
DIRECT_CALLS = ("threads", "asyncio")
DISTRIBUTIONS = ("constant", "poisson")
TENSOR_FORMATS = ("binary", "json")
DEFAULT_URLS = {"http": "localhost:8000", "grpc": "localhost:8001"}
LOAD_GENERATORS = ("kiln", "perf_analyzer")
SHARED_MEMORY = ("none", "system")
INPUT_MEMORY = ("heap", "shared")
DEFAULT_OUTPUT_SHARED_MEMORY_SIZE = 102400  # perf_analyzer's default, bytes per output region

DEFAULT_MEASUREMENT_INTERVAL_MS = 2000
"""perf_analyzer measures 5000 ms windows. A level needs at least 3 windows to be called stable, so 2000 ms keeps a
level at >= 6 s instead of 15 s (a four-level sweep in about half a minute) while a window of a model answering in
a few milliseconds still holds hundreds of requests; pass --measurement-interval 5000 for perf_analyzer's windows."""
MAX_SWEEP_LEVELS = 1024
"""A range whose end is 0 (sweep until --latency-threshold) stops here at the latest."""


# The load generator's settings, declared once for kiln bench and for kiln bench compare's served rows.
def load_generator_field(group: str) -> Any:
    return field(default="kiln", metadata=flag(
        "--load-generator", choices=LOAD_GENERATORS, group=group,
        help="http/grpc: what sends the requests: kiln (its Python client, default) or perf_analyzer (NVIDIA's C++ "
             "client, so served figures are not bounded by a Python client; pip install perf-analyzer)"))


def perf_analyzer_field(group: str) -> Any:
    return field(default=None, metadata=flag(
        "--perf-analyzer", metavar="PATH", group=group,
        help="the perf_analyzer binary (default: $KILN_PERF_ANALYZER, else perf_analyzer on PATH)"))


def shared_memory_field(group: str) -> Any:
    return field(default="none", metadata=flag(
        "--shared-memory", choices=SHARED_MEMORY, group=group,
        help="with --load-generator perf_analyzer: tensors in the request body (none, default) or in system "
             "shared memory (the server must allow it: kiln serve --allow-client-shm)"))


def output_shared_memory_size_field(group: str) -> Any:
    return field(default=DEFAULT_OUTPUT_SHARED_MEMORY_SIZE, metadata=flag(
        "--shared-memory-output-size", metavar="BYTES", group=group,
        help=f"with --shared-memory system: bytes of each output's region (perf_analyzer's "
             f"--output-shared-memory-size; default {DEFAULT_OUTPUT_SHARED_MEMORY_SIZE})"))


@dataclass(frozen=True)
class BenchOptions:
    """One ``kiln bench`` run. Exactly one of ``concurrency`` / ``request_rates`` drives the load.

    ``model`` is a model name; for the direct target without ``model_repository`` it may also be a model file
    or folder path. ``url`` is ``host:port`` (or an ``http://`` URL); http and grpc start their own ``kiln serve``
    over ``model_repository`` when no URL is given.
    """

    model: str = field(metadata=flag("-m", "--model", help="model name (direct: also a model file or folder)"))
    target: str = field(default="direct", metadata=flag(
        "--target", choices=TARGETS, default="http",
        help="direct: kiln.load in this process, N threads; inprocess: kiln.Server in this process, no network; "
             "http / grpc: a KServe V2 server (default http)"))
    url: str | None = field(default=None, metadata=flag(
        "-u", "--url", help="http/grpc server host:port (default localhost:8000 / localhost:8001; with "
                            "--model-repository and no URL, kiln bench starts `kiln serve`)"))
    model_repository: Path | None = field(default=None, metadata=flag(
        "--model-repository", help="repository holding the model (inprocess; direct: <repo>/<model>; http/grpc "
                                   "without -u: the repository of the `kiln serve` kiln bench starts)"))
    model_version: str = field(default="", metadata=flag(
        "-x", "--model-version", help="model version (default: the newest served)"))
    concurrency: tuple[int, ...] = ()  # neither this nor request_rates: concurrency 1
    request_rates: tuple[float, ...] = ()
    request_distribution: str = field(default="constant", metadata=flag(
        "--request-distribution", choices=DISTRIBUTIONS, group="load",
        help="gaps between request-rate sends (default constant)"))
    # Stop the sweep after the first level whose avg latency exceeds it.
    latency_threshold_ms: float | None = field(default=None, metadata=flag(
        "-l", "--latency-threshold", metavar="MS", group="load",
        help="stop the sweep after a level whose average latency exceeds this"))
    measurement_interval_ms: int = field(default=DEFAULT_MEASUREMENT_INTERVAL_MS, metadata=flag(
        "-p", "--measurement-interval", metavar="MS", group="measurement",
        help=f"window length (default {DEFAULT_MEASUREMENT_INTERVAL_MS})"))
    stability_percentage: float = field(default=10.0, metadata=flag(
        "-s", "--stability-percentage", group="measurement",
        help="last 3 windows within this %% on throughput and latency = stable (default 10)"))
    max_trials: int = field(default=10, metadata=flag(
        "-r", "--max-trials", group="measurement", help="most windows per level (default 10)"))
    batch_size: int = field(default=1, metadata=flag(
        "-b", "--batch-size", group="input data", help="batch size of each request (default 1)"))
    input_data: str = field(default="random", metadata=flag(  # random | zero | path to .npz or perf_analyzer JSON
        "--input-data", metavar="random|zero|FILE", group="input data",
        help="random (default), zero, a .npz (one array per input, samples first) or perf_analyzer's .json format"))
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    input_memory: str = field(default="heap", metadata=flag(
        "--input-memory", choices=INPUT_MEMORY, group="input data",
        help="direct/inprocess: the request tensors as ordinary arrays (heap, default) or in one shared host buffer "
             "that GPU engines copy to the device from in place, as they copy kiln serve's worker requests (shared)"))
    input_tensor_format: str = field(default="binary", metadata=flag(
        "--input-tensor-format", choices=TENSOR_FORMATS, group="input data", help="http only"))
    output_tensor_format: str = field(default="binary", metadata=flag(
        "--output-tensor-format", choices=TENSOR_FORMATS, group="input data", help="http only"))
    # Request-rate mode: sends beyond this many in flight are dropped.
    max_outstanding: int = field(default=64, metadata=flag(
        "--max-outstanding", group="load",
        help="request-rate mode: sends due while this many are in flight are dropped (default 64)"))
    server_pid: int | None = field(default=None, metadata=flag(
        "--server-pid", group="output",
        help="http/grpc: the server process whose memory to sample (default: found on localhost)"))
    device: str = field(default="config", metadata=flag(  # direct: EngineOptions.kind, or the instance group's
        "--device", choices=("config", "cpu", "gpu"), group="direct target",
        help="where the engine runs (config: where the model's instance group puts it)"))
    intra_op_threads: int | None = field(default=None, metadata=flag(  # direct: EngineOptions.intra_op_threads
        "--intra-op-threads", group="direct target", help="engine threads per request"))
    direct_calls: str = field(default="threads", metadata=flag(
        "--direct-calls", choices=DIRECT_CALLS, group="direct target",
        help="how the application calls the engine: threads (N threads calling engine.infer, default) or asyncio "
             "(N tasks awaiting engine.ainfer on one event loop)"))
    # http, grpc: processes that share each level's concurrency (targets/processes.py)
    client_processes: int = field(default=1, metadata=flag(
        "--client-processes", metavar="N", group="load",
        help="http/grpc: send from N processes sharing each concurrency level (one Python process cannot send "
             "large tensors as fast as a server can take them)"))
    seed: int = field(default=0, metadata=flag(
        "--seed", group="input data", help="seed of random data and poisson gaps"))
    load_generator: str = load_generator_field("load")
    perf_analyzer: str | None = perf_analyzer_field("load")
    shared_memory: str = shared_memory_field("load")
    output_shared_memory_size: int = output_shared_memory_size_field("load")

    def __post_init__(self) -> None:
        _check_choice("--target", self.target, TARGETS)
        _check_choice("--direct-calls", self.direct_calls, DIRECT_CALLS)
        _check_choice("--request-distribution", self.request_distribution, DISTRIBUTIONS)
        _check_choice("--input-tensor-format", self.input_tensor_format, TENSOR_FORMATS)
        _check_choice("--output-tensor-format", self.output_tensor_format, TENSOR_FORMATS)
        _check_choice("--device", self.device, ("config", "cpu", "gpu"))
        if not self.model:
            raise InvalidArgumentError("-m/--model is required: the name of the model to measure")
        if self.request_rates and self.concurrency:
            raise InvalidArgumentError("give either a concurrency (--concurrency-range / --concurrency) or a "
                                       "request rate (--request-rate-range), not both")
        if any(c < 1 for c in self.concurrency):
            raise InvalidArgumentError(f"concurrency levels must be >= 1, got {list(self.concurrency)}")
        if any(r <= 0 for r in self.request_rates):
            raise InvalidArgumentError(f"request rates must be > 0 requests/s, got {list(self.request_rates)}")
        if self.latency_threshold_ms is not None and self.latency_threshold_ms <= 0:
            raise InvalidArgumentError(f"--latency-threshold must be > 0 ms, got {self.latency_threshold_ms}")
        _check_positive("--measurement-interval", self.measurement_interval_ms)
        _check_positive("--max-trials", self.max_trials)
        _check_positive("-b/--batch-size", self.batch_size)
        _check_positive("--max-outstanding", self.max_outstanding)
        if self.stability_percentage <= 0:
            raise InvalidArgumentError(f"--stability-percentage must be > 0, got {self.stability_percentage}")
        if self.target in ("http", "grpc") and self.url is None and self.model_repository is None:
            raise InvalidArgumentError(f"target '{self.target}' needs -u/--url (a running server) or "
                                       f"--model-repository (kiln bench then starts `kiln serve` itself)")
        _check_positive("--client-processes", self.client_processes)
        if self.client_processes > 1 and self.target not in ("http", "grpc"):
            raise InvalidArgumentError(f"--client-processes {self.client_processes} applies to the http and grpc "
                                       f"targets; target '{self.target}' runs in this process")
        if self.client_processes > 1 and self.request_rates:
            raise InvalidArgumentError("--client-processes drives concurrency levels; with --request-rate-range "
                                       "use one client process")
        _check_choice("--input-memory", self.input_memory, INPUT_MEMORY)
        if self.input_memory != "heap" and self.target not in ("direct", "inprocess"):
            raise InvalidArgumentError(f"--input-memory {self.input_memory} applies to the direct and inprocess "
                                       f"targets; target '{self.target}' sends its tensors to another process")
        if self.target == "inprocess" and self.model_repository is None:
            raise InvalidArgumentError("target 'inprocess' needs --model-repository: the repository the in-process "
                                       "kiln.Server serves")
        self._check_load_generator()

    def _check_load_generator(self) -> None:
        _check_choice("--load-generator", self.load_generator, LOAD_GENERATORS)
        _check_choice("--shared-memory", self.shared_memory, SHARED_MEMORY)
        _check_positive("--shared-memory-output-size", self.output_shared_memory_size)
        if self.load_generator == "kiln":
            if self.shared_memory != "none":
                raise InvalidArgumentError(f"--shared-memory {self.shared_memory} needs --load-generator "
                                           f"perf_analyzer: kiln's own client sends tensors in the request body")
            return
        if self.target not in ("http", "grpc"):
            raise InvalidArgumentError(f"--load-generator {self.load_generator} drives the http and grpc targets; "
                                       f"target '{self.target}' has no server to send to")
        if self.client_processes > 1:
            raise InvalidArgumentError(f"--client-processes {self.client_processes} splits kiln's own client; "
                                       f"perf_analyzer is one C++ process with a thread per request slot")
        if self.input_data.endswith(".npz"):
            raise InvalidArgumentError(f"--input-data {self.input_data}: perf_analyzer reads random, zero or its "
                                       f".json format, not .npz")

    @property
    def request_rate_mode(self) -> bool:
        return bool(self.request_rates)

    def levels(self) -> list[float]:
        """The load levels in sweep order: concurrencies or request rates."""
        if self.request_rates:
            return list(self.request_rates)
        return [float(c) for c in self.concurrency or (1,)]

    def describe(self) -> dict[str, object]:
        """The measurement settings, as written into the JSON result."""
        return {
            "measurement_interval_ms": self.measurement_interval_ms,
            "stability_percentage": self.stability_percentage,
            "max_trials": self.max_trials,
            "request_distribution": self.request_distribution if self.request_rates else None,
            "input_data": self.input_data,
            "input_memory": self.input_memory if self.target in ("direct", "inprocess") else None,
            "shapes": {name: list(dims) for name, dims in self.shapes.items()},
            "input_tensor_format": self.input_tensor_format if self.target == "http" else None,
            "output_tensor_format": self.output_tensor_format if self.target == "http" else None,
            "latency_threshold_ms": self.latency_threshold_ms,
            "client_processes": self.client_processes if self.target in ("http", "grpc") else None,
            "load_generator": self.load_generator,
            "shared_memory": self.shared_memory if self.load_generator == "perf_analyzer" else None,
        }


def load_levels(concurrency_range: str | None, concurrency: str | None, request_rate_range: str | None,
                latency_threshold_ms: float | None) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """(concurrency levels, request rates) from the three ways of giving the load; at most one may be given."""
    given = [name for name, value in (("--concurrency-range", concurrency_range), ("--concurrency", concurrency),
                                      ("--request-rate-range", request_rate_range)) if value]
    if len(given) > 1:
        raise InvalidArgumentError(f"{' and '.join(given)} both set the load; give one of them")
    if concurrency_range:
        sweep = parse_range(concurrency_range, "--concurrency-range", integer=True)
        _check_open_ended(sweep.open_ended, latency_threshold_ms, "--concurrency-range")
        return tuple(int(v) for v in sweep.values()), ()
    if concurrency:
        return parse_list(concurrency, "--concurrency"), ()
    if request_rate_range:
        sweep = parse_range(request_rate_range, "--request-rate-range", integer=False)
        _check_open_ended(sweep.open_ended, latency_threshold_ms, "--request-rate-range")
        return (), tuple(sweep.values())
    return (), ()


def default_url(target: str, url: str | None, model_repository: Path | None) -> str | None:
    """The server a remote target measures: the given URL, else kiln serve's default port on localhost, unless a
    repository is given (kiln bench then starts `kiln serve` itself)."""
    if url is None and target in DEFAULT_URLS and model_repository is None:
        return DEFAULT_URLS[target]
    return url


def _check_open_ended(open_ended: bool, threshold: float | None, flag: str) -> None:
    if open_ended and threshold is None:
        raise InvalidArgumentError(f"{flag} ends in 0, which sweeps until --latency-threshold; set it (ms)")


def _check_choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise InvalidArgumentError(f"{flag} is '{value}'; expected one of: {', '.join(choices)}")


def _check_positive(flag: str, value: int) -> None:
    if value < 1:
        raise InvalidArgumentError(f"{flag} must be >= 1, got {value}")


@dataclass(frozen=True)
class Sweep:
    """A parsed ``start:end:step``. ``open_ended`` is perf_analyzer's end of 0: step until the latency threshold."""

    start: float
    end: float
    step: float
    open_ended: bool = False

    def values(self) -> list[float]:
        if self.open_ended:
            return [self.start + i * self.step for i in range(MAX_SWEEP_LEVELS)]
        count = int((self.end - self.start) / self.step + 1e-9) + 1
        return [self.start + i * self.step for i in range(count)]


def parse_range(text: str, flag: str, integer: bool) -> Sweep:
    """``start[:end[:step]]`` as perf_analyzer reads it: end defaults to start, step to 1; end 0 is open-ended."""
    parts = text.split(":")
    if not 1 <= len(parts) <= 3 or not all(parts):
        raise InvalidArgumentError(f"{flag} is '{text}'; expected start[:end[:step]], e.g. 1:8:1")
    try:
        numbers = [int(p) if integer else float(p) for p in parts]
    except ValueError:
        kind = "integers" if integer else "numbers"
        raise InvalidArgumentError(f"{flag} is '{text}'; start, end and step must be {kind}") from None
    start = numbers[0]
    end = numbers[1] if len(numbers) > 1 else start
    step = numbers[2] if len(numbers) > 2 else 1
    if start <= 0 or step <= 0:
        raise InvalidArgumentError(f"{flag} is '{text}'; start and step must be > 0")
    if end != 0 and end < start:
        raise InvalidArgumentError(f"{flag} is '{text}'; end ({end}) is below start ({start}) (0 = no end)")
    return Sweep(float(start), float(end), float(step), open_ended=end == 0)


def parse_list(text: str, flag: str) -> tuple[int, ...]:
    """``1,2,4,8``: explicit concurrency levels, run in the given order."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise InvalidArgumentError(f"{flag} is '{text}'; expected comma-separated integers, e.g. 1,2,4,8") from None
    if any(v < 1 for v in values):
        raise InvalidArgumentError(f"{flag} is '{text}'; every level must be >= 1")
    return values


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """``NAME:d1,d2,...``: an input's dims without the batch dimension (perf_analyzer's --shape)."""
    name, sep, dims = text.rpartition(":")
    if not sep or not name or not dims:
        raise InvalidArgumentError(f"--shape is '{text}'; expected NAME:d1,d2,... e.g. INPUT0:3,224,224")
    try:
        shape = tuple(int(d) for d in dims.split(","))
    except ValueError:
        raise InvalidArgumentError(f"--shape is '{text}'; dimensions must be integers, e.g. INPUT0:3,224,224") from None
    if any(d < 0 for d in shape):
        raise InvalidArgumentError(f"--shape is '{text}'; dimensions must be >= 0")
    return name, shape
