"""The soak test's client processes (benchmarks/soak.py starts them): steady, checked traffic over HTTP or gRPC
with the official tritonclient, and a chaos process of raw sockets (connections cut mid-headers, mid-body and
after the request, slow clients trickling their bytes) and cancelled gRPC streams.

Run as ``python _soak_traffic.py CONFIG.json``. Every answer is checked against a reference computed here with
numpy, without kiln. The process writes one JSON line per sample window to ``config["out"]``: the latencies of the
window's well-formed requests by operation, their counts, every wrong answer and every failure (with its model and
its start and end on the system-wide monotonic clock, so the parent can tell a failure inside a planned unload from
a real one), the versions that answered, and what the chaos clients did.
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from onnx import numpy_helper

Array = np.ndarray[Any, Any]
MAX_RECORDED = 50  # wrong answers kept per window and process (all are counted; every failure is kept, for
# the parent to classify)


class WrongAnswer(Exception):
    """The server answered, and the answer differs from the reference."""


class _Aborted(Exception):
    """The current operation stops: one of its requests failed or was answered wrongly (already counted)."""


# --------------------------------------------------------------------------------------------------------------
# Per-window accounting


class Tally:
    """What one process saw, by sample window (the window a request finished in); written as JSON lines."""

    def __init__(self, t0: float, window_s: float, out: Path) -> None:
        self.t0, self.window_s = t0, window_s
        self._file = out.open("w")
        self._lock = threading.Lock()
        self._windows: dict[int, dict[str, Any]] = {}

    def _window(self, now: float) -> dict[str, Any]:
        index = int((now - self.t0) // self.window_s)
        if index not in self._windows:
            self._windows[index] = {"window": index, "pid": os.getpid(), "latencies_ms": defaultdict(list),
                                    "ok": Counter(), "wrong": 0, "failed": 0, "wrong_answers": [], "failures": [],
                                    "versions": Counter(), "chaos": Counter()}
            self._flush_before(index)
        return self._windows[index]

    def ok(self, operation: str, latency_s: float, version: str | None = None, model: str = "") -> None:
        with self._lock:
            window = self._window(time.monotonic())
            window["latencies_ms"][operation].append(round(latency_s * 1000, 3))
            window["ok"][operation] += 1
            if version:
                window["versions"][f"{model}:{version}"] += 1

    def wrong(self, operation: str, message: str) -> None:
        with self._lock:
            window = self._window(time.monotonic())
            window["wrong"] += 1
            if len(window["wrong_answers"]) < MAX_RECORDED:
                window["wrong_answers"].append({"operation": operation, "message": message[:500]})

    def failed(self, operation: str, model: str, start: float, message: str) -> None:
        with self._lock:
            end = time.monotonic()
            window = self._window(end)
            window["failed"] += 1
            window["failures"].append({"operation": operation, "model": model, "start": start, "end": end,
                                       "message": message[:300]})

    def chaos(self, event: str) -> None:
        with self._lock:
            self._window(time.monotonic())["chaos"][event] += 1

    def _flush_before(self, index: int) -> None:
        for done in sorted(i for i in self._windows if i < index - 1):  # a window is kept one more for stragglers
            self._write(self._windows.pop(done))

    def close(self) -> None:
        with self._lock:
            for index in sorted(self._windows):
                self._write(self._windows.pop(index))
            self._file.close()

    def _write(self, window: dict[str, Any]) -> None:
        self._file.write(json.dumps(window) + "\n")
        self._file.flush()


# --------------------------------------------------------------------------------------------------------------
# Reference answers (numpy only)


class Reference:
    """The demo models' answers, computed from their definitions and the mlp's ONNX initializers."""

    def __init__(self, mlp_onnx: Path) -> None:
        model = onnx.load(str(mlp_onnx))
        weights = {init.name: numpy_helper.to_array(init).astype(np.float64) for init in model.graph.initializer}
        layers = sorted({name.split(".")[0] for name in weights}, key=lambda layer: int(layer[2:]))
        self._layers = [(weights[f"{layer}.weight"], weights[f"{layer}.bias"]) for layer in layers]

    def mlp(self, x: Array) -> Array:
        h = x.astype(np.float64)
        for i, (weight, bias) in enumerate(self._layers):
            h = h @ weight.T + bias
            if i != len(self._layers) - 1:
                h = np.maximum(h, 0.0)
        return h

    def pipeline(self, raw: Array) -> tuple[Array, Array]:
        logits = self.mlp((raw.astype(np.float64) - 127.5) / 64.0)
        shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return shifted / shifted.sum(axis=-1, keepdims=True), logits


def check_equal(name: str, got: Array | None, want: Array) -> None:
    if got is None or got.shape != want.shape or not np.array_equal(got, want):
        raise WrongAnswer(f"{name}: got {None if got is None else got.tolist()}, expected {want.tolist()}")


def check_close(name: str, got: Array | None, want: Array) -> None:
    if got is None or got.shape != want.shape or not np.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise WrongAnswer(f"{name}: got {None if got is None else got.tolist()}, expected {want.tolist()}")


def check_class(got: Array | None, probs: Array) -> None:
    """The pipeline's CLASS is the reference's argmax, unless the two top classes tie within rounding."""
    top2 = np.sort(probs, axis=-1)[..., -2:]
    if got is None or (int(got.reshape(-1)[0]) != int(probs.argmax()) and top2[0, 1] - top2[0, 0] > 1e-5):
        raise WrongAnswer(f"CLASS: got {None if got is None else got.tolist()}, expected {int(probs.argmax())}")


# --------------------------------------------------------------------------------------------------------------
# Steady traffic: one client, operations in turn, paced


class Traffic:
    """One protocol's client cycling through the operations the soak checks; each call counted in ``tally``."""

    def __init__(self, config: dict[str, Any], tally: Tally) -> None:
        self.config, self.tally = config, tally
        self.grpc = config["protocol"] == "grpc"
        self.module: Any = grpcclient if self.grpc else httpclient
        timeout = float(config["request_timeout_s"])
        self.client: Any = (grpcclient.InferenceServerClient(config["grpc_url"]) if self.grpc else
                            httpclient.InferenceServerClient(config["http_url"], connection_timeout=timeout,
                                                             network_timeout=timeout))
        self.timeout = timeout
        self.reference = Reference(Path(config["mlp_onnx"]))
        self.rng = np.random.default_rng([os.getpid(), int(config["index"])])
        self.sequence_id = (int(config["index"]) + 1) * 10_000_000 + (1 if self.grpc else 5_000_000)
        self.shm = _ShmRegions(self, int(config["shm_rotate_every"]))
        self.operations: list[Callable[[], None]] = [
            self.simple_json, self.simple_binary, self.ab_mlp, self.pipeline, self.simple_string, self.sequence,
            self.shm.simple_in_shm]
        if self.grpc:
            self.operations.append(self.repeat_stream)

    # -- the call wrapper ------------------------------------------------------------------------------------

    def measure(self, operation: str, model: str, send: Callable[[], Any], check: Callable[[Any], None]) -> Any:
        start = time.monotonic()
        try:
            result = send()
        except Exception as exc:  # every error of a request is a failure here; the parent classifies it
            self.tally.failed(operation, model, start, f"{type(exc).__name__}: {exc}")
            raise _Aborted from exc
        latency = time.monotonic() - start
        try:
            check(result)
        except WrongAnswer as exc:
            self.tally.wrong(operation, f"{model}: {exc}")
            raise _Aborted from exc
        self.tally.ok(operation, latency, _version(result, self.grpc) if model == "mlp" else None, model)
        return result

    def infer(self, model: str, inputs: list[Any], outputs: list[Any] | None = None, **kwargs: Any) -> Any:
        if self.grpc:
            return self.client.infer(model, inputs, outputs=outputs, client_timeout=self.timeout, **kwargs)
        return self.client.infer(model, inputs, outputs=outputs, **kwargs)

    def tensor(self, name: str, value: Array, datatype: str, binary: bool = True) -> Any:
        tensor = self.module.InferInput(name, list(value.shape), datatype)
        if self.grpc:
            tensor.set_data_from_numpy(value)
        else:
            tensor.set_data_from_numpy(value, binary_data=binary)
        return tensor

    def wanted(self, names: list[str], binary: bool) -> list[Any] | None:
        if self.grpc:
            return None
        return [httpclient.InferRequestedOutput(name, binary_data=binary) for name in names]

    # -- the operations --------------------------------------------------------------------------------------

    def _simple(self, operation: str, binary: bool) -> None:
        a = self.rng.integers(-1000, 1000, (1, 16), dtype=np.int32)
        b = self.rng.integers(-1000, 1000, (1, 16), dtype=np.int32)
        inputs = [self.tensor("INPUT0", a, "INT32", binary), self.tensor("INPUT1", b, "INT32", binary)]

        def check(result: Any) -> None:
            check_equal("OUTPUT0", result.as_numpy("OUTPUT0"), a + b)
            check_equal("OUTPUT1", result.as_numpy("OUTPUT1"), a - b)

        self.measure(operation, "simple", lambda: self.infer("simple", inputs, self.wanted(["OUTPUT0", "OUTPUT1"],
                                                                                            binary)), check)

    def simple_json(self) -> None:
        self._simple("simple json" if not self.grpc else "simple", binary=False)

    def simple_binary(self) -> None:
        self._simple("simple binary" if not self.grpc else "simple", binary=True)

    def ab_mlp(self) -> None:
        """mlp without a version: kiln's A/B routing picks one of the two newest; half the calls carry a sticky
        routing key."""
        x = self.rng.standard_normal((1, 64)).astype(np.float32)
        kwargs: dict[str, Any] = {}
        if self.rng.random() < 0.5:
            kwargs["parameters"] = {"routing_key": f"user-{int(self.rng.integers(1000))}"}
        self.measure("mlp a/b", "mlp", lambda: self.infer("mlp", [self.tensor("INPUT0", x, "FP32")], **kwargs),
                     lambda result: check_close("OUTPUT0", result.as_numpy("OUTPUT0"), self.reference.mlp(x)))

    def pipeline(self) -> None:
        raw = self.rng.integers(0, 256, (1, 64), dtype=np.int32)
        probs, _ = self.reference.pipeline(raw)

        def check(result: Any) -> None:
            check_close("PROBS", result.as_numpy("PROBS"), probs)
            check_class(result.as_numpy("CLASS"), probs)

        self.measure("ensemble", "mlp_pipeline",
                     lambda: self.infer("mlp_pipeline", [self.tensor("RAW", raw, "INT32")]), check)

    def simple_string(self) -> None:
        a = self.rng.integers(-1000, 1000, 16)
        b = self.rng.integers(-1000, 1000, 16)
        as_bytes = [np.array([[str(v).encode() for v in values]], dtype=np.object_) for values in (a, b)]
        inputs = [self.tensor(f"INPUT{i}", value, "BYTES", binary=i == 0) for i, value in enumerate(as_bytes)]

        def check(result: Any) -> None:
            for name, want in (("OUTPUT0", a + b), ("OUTPUT1", a - b)):
                got = result.as_numpy(name)
                expected = np.array([[str(v).encode() for v in want]], dtype=np.object_)
                check_equal(name, None if got is None else got.astype(np.object_), expected)

        self.measure("simple_string", "simple_string", lambda: self.infer("simple_string", inputs), check)

    def sequence(self) -> None:
        """A whole sequence on simple_dyna_sequence: OUTPUT = INPUT + START + END * CORRID on each request."""
        self.sequence_id += 1
        values = self.rng.integers(-100, 100, int(self.rng.integers(2, 6)), dtype=np.int32)
        for step, value in enumerate(values):
            start, end = step == 0, step == len(values) - 1
            x = np.array([[value]], dtype=np.int32)
            want = x + int(start) + int(end) * self.sequence_id
            send = functools.partial(self.infer, "simple_dyna_sequence", [self.tensor("INPUT", x, "INT32")],
                                     sequence_id=self.sequence_id, sequence_start=start, sequence_end=end)
            self.measure("sequence", "simple_dyna_sequence", send,
                         functools.partial(_check_output, "OUTPUT", want=want))

    def repeat_stream(self) -> None:
        """repeat_int32 (decoupled) over a gRPC stream: one response per value, in order, then the final flag."""
        values = self.rng.integers(-1000, 1000, int(self.rng.integers(1, 5)), dtype=np.int32)
        inputs = [self.tensor("IN", values, "INT32"), self.tensor("DELAY", np.zeros(len(values), np.uint32), "UINT32"),
                  self.tensor("WAIT", np.zeros(1, np.uint32), "UINT32")]
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()

        def send() -> list[tuple[int, int]]:
            self.client.start_stream(callback=lambda result, error: answers.put((result, error)))
            try:
                self.client.async_stream_infer("repeat_int32", inputs, enable_empty_final_response=True)
                got: list[tuple[int, int]] = []
                while True:
                    result, error = answers.get(timeout=self.timeout)
                    if error is not None:
                        raise error
                    response = result.get_response()
                    if response.parameters["triton_final_response"].bool_param and not response.outputs:
                        return got
                    got.append((int(result.as_numpy("IDX")[0]), int(result.as_numpy("OUT")[0])))
            finally:
                self.client.stop_stream()

        def check(got: list[tuple[int, int]]) -> None:
            if got != [(i, int(v)) for i, v in enumerate(values)]:
                raise WrongAnswer(f"responses (IDX, OUT) {got}, expected {list(enumerate(values.tolist()))}")

        self.measure("repeat stream", "repeat_int32", send, check)

    def close(self) -> None:
        self.shm.close()
        self.client.close()


def _check_output(name: str, result: Any, want: Array) -> None:
    check_equal(name, result.as_numpy(name), want)


def _version(result: Any, grpc: bool) -> str:
    response = result.get_response()
    return str(response.model_version if grpc else response.get("model_version", ""))


class _ShmRegions:
    """An input and an output system shared-memory region for ``simple``, registered with the server and replaced
    by a fresh pair (unregister, destroy, create, register) every ``rotate_every`` requests."""

    TENSOR_BYTES = 16 * 4

    def __init__(self, traffic: Traffic, rotate_every: int) -> None:
        self.traffic, self.rotate_every = traffic, rotate_every
        self.generation, self.uses = 0, 0
        self.handles: list[Any] = []
        self.names: list[str] = []

    def _open(self) -> None:
        self.generation += 1
        tag = f"soak_{os.getpid()}_{self.generation}"
        self.names = [f"{tag}_in", f"{tag}_out"]
        self.handles = [shm.create_shared_memory_region(name, f"/{name}", 2 * self.TENSOR_BYTES) for name in self.names]
        client = self.traffic.client
        for name in self.names:
            register = functools.partial(client.register_system_shared_memory, name, f"/{name}", 2 * self.TENSOR_BYTES)
            self.traffic.measure("shm register", "<shm>", register, lambda _: None)

    def close(self, counted: bool = False) -> None:
        """Unregister and destroy the pair; ``counted``: each unregister call is a well-formed request (not at the
        end of the run, when the server may already be stopping)."""
        client = self.traffic.client
        for name in self.names:
            try:
                if counted:
                    self.traffic.measure("shm unregister", "<shm>",
                                         functools.partial(client.unregister_system_shared_memory, name),
                                         lambda _: None)
                else:
                    client.unregister_system_shared_memory(name)
            except Exception:  # counted above when it matters; the region is destroyed below either way
                pass
        for handle in self.handles:
            shm.destroy_shared_memory_region(handle)
        self.handles, self.names, self.uses = [], [], 0

    def simple_in_shm(self) -> None:
        if self.uses >= self.rotate_every:
            self.close(counted=True)
        if not self.handles:
            self._open()
        self.uses += 1
        traffic, size = self.traffic, self.TENSOR_BYTES
        a = traffic.rng.integers(-1000, 1000, (1, 16), dtype=np.int32)
        b = traffic.rng.integers(-1000, 1000, (1, 16), dtype=np.int32)
        shm.set_shared_memory_region(self.handles[0], [a, b])
        inputs = [traffic.module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
        outputs = [traffic.module.InferRequestedOutput(name) for name in ("OUTPUT0", "OUTPUT1")]
        for i in range(2):
            inputs[i].set_shared_memory(self.names[0], size, offset=i * size)
            outputs[i].set_shared_memory(self.names[1], size, offset=i * size)

        def check(_: Any) -> None:
            check_equal("OUTPUT0", shm.get_contents_as_numpy(self.handles[1], np.int32, [1, 16]), a + b)
            check_equal("OUTPUT1", shm.get_contents_as_numpy(self.handles[1], np.int32, [1, 16], offset=size), a - b)

        traffic.measure("simple shm", "simple", lambda: traffic.infer("simple", inputs, outputs), check)


def run_traffic(config: dict[str, Any], tally: Tally) -> None:
    traffic = Traffic(config, tally)
    try:
        _paced(config, float(config["rate"]), lambda step: traffic.operations[step % len(traffic.operations)]())
    finally:
        traffic.close()


def _paced(config: dict[str, Any], rate: float, action: Callable[[int], None]) -> None:
    """``action(step)`` ``rate`` times per second from ``config["t0"]`` until ``config["stop_at"]``; a late step
    starts at once and the schedule does not try to catch up."""
    interval, stop_at = 1.0 / rate, float(config["stop_at"])
    next_at, step = max(time.monotonic(), float(config["t0"])), 0
    while next_at < stop_at:
        time.sleep(max(0.0, next_at - time.monotonic()))
        try:
            action(step)
        except _Aborted:
            pass
        step += 1
        next_at = max(next_at + interval, time.monotonic())


# --------------------------------------------------------------------------------------------------------------
# Chaos: raw sockets and cancelled streams


def _simple_request(http_url: str) -> tuple[bytes, bytes, Array, Array]:
    """A JSON ``simple`` request as raw HTTP/1.1: its head, its body and the two inputs."""
    a = np.random.default_rng().integers(-1000, 1000, 16).astype(np.int32)
    b = np.random.default_rng().integers(-1000, 1000, 16).astype(np.int32)
    body = json.dumps({"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": a.tolist()},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": b.tolist()}]}).encode()
    head = (f"POST /v2/models/simple/infer HTTP/1.1\r\nHost: {http_url}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return head, body, a, b


def _connect(http_url: str, timeout_s: float) -> socket.socket:
    host, port = http_url.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout_s)


def cut_connections(config: dict[str, Any], tally: Tally) -> None:
    """Connections closed mid-headers, mid-body and right after the whole request, in turn."""
    url = config["http_url"]

    def cut(step: int) -> None:
        head, body, _, _ = _simple_request(url)
        where = ("mid-headers", "mid-body", "after request")[step % 3]
        sent = {"mid-headers": head[:len(head) // 2], "mid-body": head + body[:len(body) // 2],
                "after request": head + body}[where]
        try:
            with _connect(url, 5.0) as sock:
                sock.sendall(sent)
            tally.chaos(f"cut {where}")
        except OSError:
            tally.chaos(f"cut {where}: could not connect")

    _paced(config, float(config["cut_rate"]), cut)


def slow_clients(config: dict[str, Any], tally: Tally) -> None:
    """Requests trickled ``slow_chunk_bytes`` at a time, ``slow_chunk_delay_ms`` apart, then answered and checked.
    The server may cut a client slower than its header or body timeouts: counted apart, never as a failure."""
    url, chunk, delay = config["http_url"], int(config["slow_chunk_bytes"]), float(config["slow_chunk_delay_ms"]) / 1000
    time.sleep(max(0.0, float(config["t0"]) - time.monotonic()))
    while time.monotonic() < float(config["stop_at"]):
        head, body, a, b = _simple_request(url)
        data = head + body
        try:
            with _connect(url, float(config["request_timeout_s"])) as sock:
                for offset in range(0, len(data), chunk):
                    sock.sendall(data[offset:offset + chunk])
                    time.sleep(delay)
                response = http.client.HTTPResponse(sock)
                response.begin()
                answer = response.read()
        except (OSError, http.client.HTTPException):
            tally.chaos("slow: cut by the server")
            continue
        if response.status != 200:
            tally.chaos(f"slow: HTTP {response.status}")
            continue
        outputs = {out["name"]: out["data"] for out in json.loads(answer)["outputs"]}
        if outputs.get("OUTPUT0") != (a + b).tolist() or outputs.get("OUTPUT1") != (a - b).tolist():
            tally.wrong("slow client", f"simple: got {outputs}, expected {(a + b).tolist()}, {(a - b).tolist()}")
        else:
            tally.chaos("slow: answered")


def cancelled_streams(config: dict[str, Any], tally: Tally) -> None:
    """repeat_int32 streams closed with their requests cancelled after the first of several delayed responses."""
    client = grpcclient.InferenceServerClient(config["grpc_url"])
    values = np.arange(4, dtype=np.int32)
    inputs = [grpcclient.InferInput("IN", [4], "INT32"), grpcclient.InferInput("DELAY", [4], "UINT32"),
              grpcclient.InferInput("WAIT", [1], "UINT32")]
    inputs[0].set_data_from_numpy(values)
    inputs[1].set_data_from_numpy(np.full(4, 50, np.uint32))
    inputs[2].set_data_from_numpy(np.zeros(1, np.uint32))

    def cancel(_: int) -> None:
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            client.async_stream_infer("repeat_int32", inputs)
            answers.get(timeout=5)
            tally.chaos("stream cancelled")
        except queue.Empty:
            tally.chaos("stream cancelled: no first response")
        except Exception as exc:  # tritonclient's error for a broken stream; counted, and the next one starts
            tally.chaos(f"stream cancelled: {type(exc).__name__}")
        finally:
            client.stop_stream(cancel_requests=True)

    try:
        _paced(config, float(config["cancel_rate"]), cancel)
    finally:
        client.close()


def run_chaos(config: dict[str, Any], tally: Tally) -> None:
    jobs: list[Callable[[dict[str, Any], Tally], None]] = [cut_connections, cancelled_streams]
    jobs += [slow_clients] * int(config["slow_clients"])
    threads = [threading.Thread(target=job, args=(config, tally), daemon=True) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _await_start(config: dict[str, Any]) -> None:
    """Say this process is ready (imports done), then wait for the common start: the server's addresses, ``t0`` and
    ``stop_at``, written by the parent once the server and every client are ready."""
    Path(config["ready_file"]).touch()
    start_file, deadline = Path(config["start_file"]), time.monotonic() + 300
    while not start_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no start signal in {start_file} after 300 s")
        time.sleep(0.05)
    config.update(json.loads(start_file.read_text()))


def main(argv: list[str]) -> int:
    config = json.loads(Path(argv[0]).read_text())
    # SIGTERM (the parent stopping the run early) ends the process through the `finally` that writes the counts.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    _await_start(config)
    tally = Tally(float(config["t0"]), float(config["window_s"]), Path(config["out"]))
    try:
        (run_chaos if config["protocol"] == "chaos" else run_traffic)(config, tally)
    finally:
        tally.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
