"""What the kiln benchmarks share that is not the package's: the checkout they measure, the header of every output,
demo-model requests with answers computed independently of kiln, and servers other than `kiln serve`.

The package supplies the rest: the machine description (:mod:`kiln.bench.machine`), Markdown tables
(:mod:`kiln.bench.report`), `kiln serve` child processes (:mod:`kiln.serve_process`), request bodies and response
decoding (:mod:`kiln.v2.http_codec`, :mod:`kiln.v2.grpc_codec`) and the client (:mod:`kiln.v2.client`). Importing
this module puts this checkout's ``src/`` first on ``sys.path`` and on ``PYTHONPATH``, so a script and every
process it starts measure the code beside it, installed or not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")) if p)

from kiln.bench.data import Array as Array  # re-exported: the scripts annotate arrays with it
from kiln.bench.data import Request
from kiln.bench.machine import machine_info
from kiln.bench.report import Table, machine_line, markdown_table
from kiln.tensor import DataType
from kiln.v2 import grpc_codec, http_codec
from kiln.v2._generated import grpc_service_pb2 as pb
from kiln.v2.client import HttpClient, Response
from kiln.v2.client.calls import decode_infer

HOST = "127.0.0.1"
BENCH_DIR = Path(__file__).resolve().parent
SRC = BENCH_DIR.parent / "src"
_MORE_PACKAGES = ("starlette", "httptools", "protobuf", "orjson", "prometheus-client", "tritonclient", "granian")


# --------------------------------------------------------------------------------------------------------------
# What every output starts with


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])


def describe(title: str, **extra: object) -> dict[str, Any]:
    """The machine (:func:`kiln.bench.machine.machine_info` plus the serving stack's packages), the command and
    ``extra`` entries (load generator versions, a GPU's name, ...)."""
    info = machine_info()
    for name in _MORE_PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info["packages"][name] = importlib.metadata.version(name)
    return {**info, "title": title, "command": command_line(), **extra}


def header(info: Mapping[str, Any]) -> str:
    lines = [f"# {info['title']}", f"command: {info['command']}", f"date: {info['date']}",
             f"machine: {machine_line(dict(info))}",
             "packages: " + ", ".join(f"{name} {version}" for name, version in info["packages"].items())]
    for key, value in info.items():
        if key not in _SHOWN:
            shown = ", ".join(f"{k} {v}" for k, v in value.items()) if isinstance(value, Mapping) else value
            lines.append(f"{key}: {shown}")
    return "\n".join(lines) + "\n"


_SHOWN = {"title", "command", "date", "cpu_model", "cpu_count", "memory_total", "os", "python", "kiln", "packages",
          "gpus", "gpu_memory_source"}


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], numeric_from: int = 1) -> str:
    """A Markdown table; columns from ``numeric_from`` on are right-aligned numbers."""
    return markdown_table(Table(list(headers), [[cell(value) for value in row] for row in rows], numeric_from))


def cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # NaN: nothing was measured
            return "-"
        digits = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2 if abs(value) >= 1 else 3
        return f"{value:,.{digits}f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def write_outputs(output: Path | None, data: Mapping[str, Any], text: str) -> None:
    """``data`` as JSON at ``output`` and ``text`` beside it (``.txt``); nothing without ``output``."""
    if output is None:
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")
    output.with_suffix(".txt").write_text(text)


def _json_default(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value)}")


def int_list(text: str) -> list[int]:
    """``"1,8,16"`` -> ``[1, 8, 16]`` (empty items ignored)."""
    return [int(item) for item in text.split(",") if item.strip()]


def str_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


# --------------------------------------------------------------------------------------------------------------
# Demo-model requests and their answers, computed independently of kiln and ONNX Runtime


@dataclasses.dataclass(frozen=True)
class Case:
    """One request to a model, in every wire format, and the answer it must get."""

    model: str
    request: Request
    datatypes: dict[str, DataType]
    expected: dict[str, Array]

    def json_body(self) -> tuple[bytes, dict[str, str]]:
        return http_codec.encode_request(self.request, datatypes=self.datatypes, binary_input=False,
                                         binary_output=False)

    def binary_body(self) -> tuple[bytes, dict[str, str]]:
        """The binary tensor data extension: a JSON header, then the raw input bytes; binary outputs."""
        return http_codec.encode_request(self.request, datatypes=self.datatypes)

    def grpc_message(self) -> bytes:
        """A serialized ModelInferRequest carrying every input in ``raw_input_contents``."""
        return grpc_codec.encode_request(self.model, self.request, datatypes=self.datatypes).SerializeToString()


def simple_case() -> Case:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    return Case("simple", {"INPUT0": a, "INPUT1": b}, {"INPUT0": DataType.INT32, "INPUT1": DataType.INT32},
                {"OUTPUT0": a + b, "OUTPUT1": a - b})


def mlp_case(model_onnx: Path) -> Case:
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
    return Case("mlp", {"INPUT0": x}, {"INPUT0": DataType.FP32}, {"OUTPUT0": h.astype(np.float32)})


def model_case(repo: Path, model: str) -> Case:
    if model == "simple":
        return simple_case()
    if model == "mlp":
        return mlp_case(repo / "mlp" / "1" / "model.onnx")
    raise SystemExit(f"unknown model '{model}' (expected simple or mlp)")


def check_outputs(got: Mapping[str, Array], expected: Mapping[str, Array], what: str) -> None:
    """Raise AssertionError unless ``got`` has exactly the expected outputs, shapes, dtypes and values."""
    if set(got) != set(expected):
        raise AssertionError(f"{what}: outputs {sorted(got)} != expected {sorted(expected)}")
    for name, want in expected.items():
        have = got[name]
        if tuple(have.shape) != tuple(want.shape) or have.dtype != want.dtype:
            raise AssertionError(f"{what}: {name} is {have.dtype}{list(have.shape)}, expected {want.dtype}"
                                 f"{list(want.shape)}")
        same = np.allclose(have, want, rtol=1e-4, atol=1e-5) if want.dtype.kind == "f" else np.array_equal(have, want)
        if not same:
            raise AssertionError(f"{what}: {name} differs from the reference (max abs diff "
                                 f"{float(np.max(np.abs(have.astype(np.float64) - want))):.3g})")


# --------------------------------------------------------------------------------------------------------------
# One verified call before a load generator repeats it


def post(http_url: str, path: str, body: bytes, headers: Mapping[str, str]) -> Response:
    """One POST to ``host:port`` through kiln's client."""
    with HttpClient(http_url) as client:
        return client.request("POST", path, body, headers)


def verify_http(http_url: str, case: Case, binary: bool) -> tuple[bytes, dict[str, str]]:
    """POST the case's body once, check the answer, and return the body and headers a load generator will send."""
    body, headers = case.binary_body() if binary else case.json_body()
    what = f"{case.model} over HTTP ({'binary' if binary else 'JSON'}) at {http_url}"
    response = post(http_url, f"/v2/models/{case.model}/infer", body, headers)
    if response.status != 200:
        raise AssertionError(f"{what}: HTTP {response.status}: {response.body[:500]!r}")
    if binary and http_codec.HEADER_LENGTH not in response.headers:
        raise AssertionError(f"{what}: the response is not in the binary tensor data extension")
    check_outputs(decode_infer(response).arrays(), case.expected, what)
    return body, headers


def grpc_unary(grpc_url: str, path: str, message: bytes, timeout: float = 60.0) -> bytes:
    """Send already-serialized bytes to a unary method; return the serialized response."""
    import grpc

    with grpc.insecure_channel(grpc_url) as channel:
        call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
        data: bytes = call(message, timeout=timeout)
        return data


def verify_grpc(grpc_url: str, case: Case) -> tuple[bytes, bytes]:
    """Send the case's ModelInferRequest once, check the answer; return the request and the response bytes."""
    message = case.grpc_message()
    response = grpc_unary(grpc_url, "/inference.GRPCInferenceService/ModelInfer", message)
    decoded = grpc_codec.decode_response(pb.ModelInferResponse.FromString(response))
    check_outputs(decoded.arrays(), case.expected, f"{case.model} over gRPC at {grpc_url}")
    return message, response


# --------------------------------------------------------------------------------------------------------------
# Servers that are not `kiln serve` (kiln.serve_process starts those): their own process group, stopped whole


@contextlib.contextmanager
def spawned(cmd: Sequence[str], log_path: Path, cwd: Path | None = None,
            env: Mapping[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A server in its own process group, output to ``log_path``; SIGTERM to the group on exit, then SIGKILL
    (workers it forked go with it)."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                   env=None if env is None else dict(env), start_new_session=True)
        try:
            yield process
        finally:
            stop_group(process)


def stop_group(process: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


def wait_http_ok(http_url: str, paths: Sequence[str], process: subprocess.Popen[bytes], log_path: Path,
                 timeout_s: float = 180.0) -> None:
    """Until every path answers 200 (in order); fails with the log's tail when the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    for path in paths:
        while not _answers_200(f"http://{http_url}{path}"):
            if process.poll() is not None:
                raise RuntimeError(f"{process.args!r} exited with {process.returncode}; log:\n{log_tail(log_path)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{path} did not answer 200 within {timeout_s:.0f} s; log:\n{log_tail(log_path)}")
            time.sleep(0.05)


def _answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def http_worker_processes(server_pid: int) -> list[Any]:
    """The HTTP worker processes (psutil) of the `kiln serve` process ``server_pid``."""
    import psutil

    return [child for child in psutil.Process(server_pid).children()
            if "kiln.frontends.http.worker" in " ".join(child.cmdline())]


def log_tail(path: Path, size: int = 4000) -> str:
    with contextlib.suppress(OSError):
        return path.read_bytes()[-size:].decode(errors="replace")
    return ""


@contextlib.contextmanager
def pythonpath(src: Path) -> Iterator[None]:
    """``PYTHONPATH=src`` for the processes started inside the block (kiln_serve's child inherits the environment):
    a server from another checkout, e.g. the code before a change."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(src.resolve())
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def kiln_serve_command(repo: Path, http_port: int, grpc_port: int, metrics_port: int) -> list[str]:
    """What :func:`kiln.serve_process.kiln_serve` runs, for a script that must time the spawn itself."""
    return [sys.executable, "-m", "kiln.cli", "serve", "--model-repository", str(repo), "--http-port", str(http_port),
            "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port)]
