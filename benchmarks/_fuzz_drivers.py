"""Sending fuzz inputs: the HTTP app in process (httpx over ASGI, no sockets), a `kiln serve` over the wire (HTTP
through uvicorn's parsers, raw request heads on a socket, gRPC with raw bytes), and config / repository cases
through kiln's parser and model-folder reader. Each driver also runs the checker: a well-formed ``simple`` request,
sent between and alongside fuzz inputs, whose answer must stay the independently computed one.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
from _fuzz_cases import GRPC_INFER, SHM_BYTES, SHM_KEY, WIDTH, ConfigCase, GrpcCase, HttpCase, mutate_bytes
from _fuzz_oracle import Answer, Finding, judge_grpc, judge_http

from kiln.config.model_dir import open_model_dir
from kiln.config.parse import parse_config_text
from kiln.config.repository import scan_repositories
from kiln.errors import KilnError
from kiln.server.capture import CaptureStore
from kiln.server.server import Server, ServerOptions
from kiln.tensor import DataType
from kiln.testing import onnx_add_sub_model, write_model
from kiln.testing.serve import KilnProcess, kiln_serve
from kiln.v2._generated import grpc_service_pb2 as pb

CLIENT_REFUSALS = (httpx.InvalidURL, httpx.UnsupportedProtocol, httpx.LocalProtocolError, UnicodeEncodeError)
"""What httpx refuses to send (a NUL in a header, a non-ASCII path): no request reached the server."""
TIMEOUT_S = 10.0  # per request: longer is a hang
LIMIT = 64 * 1024  # --http-max-input-size of the fuzzed servers: small, so oversized bodies stay cheap
SIMPLE_CONFIG = """name: "simple"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
        { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
         { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
"""
STRINGS_CONFIG = """name: "strings"
backend: "identity"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
"""


def build_fuzz_repository(root: Path) -> Path:
    """``simple`` (ONNX Add/Sub on INT32 [16]) and ``strings`` (a BYTES identity)."""
    write_model(root, "simple", onnx_add_sub_model(DataType.INT32, (WIDTH,), name="simple"), SIMPLE_CONFIG)
    write_model(root, "strings", None, STRINGS_CONFIG)
    return root


def served_files(root: Path) -> frozenset[bytes]:
    """What a download may return: the files of the fuzz repository's models."""
    return frozenset(p.read_bytes() for p in root.rglob("*") if p.is_file())


@contextmanager
def shm_object(tag: str) -> Iterator[Path]:
    """The fuzzer's own shared-memory object (a /dev/shm file of SHM_BYTES), removed afterwards."""
    path = Path("/dev/shm") / SHM_KEY.format(tag=tag).lstrip("/")
    path.write_bytes(bytes(range(256)) * (SHM_BYTES // 256))
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


# -- the checker ----------------------------------------------------------------------------------------------


def checker_request(rng: random.Random) -> tuple[bytes, np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    a = np.asarray([rng.randint(-1000, 1000) for _ in range(WIDTH)], np.int32)
    b = np.asarray([rng.randint(-1000, 1000) for _ in range(WIDTH)], np.int32)
    doc = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, WIDTH], "data": a.tolist()},
                      {"name": "INPUT1", "datatype": "INT32", "shape": [1, WIDTH], "data": b.tolist()}]}
    import json
    return json.dumps(doc).encode(), a + b, a - b


def checker_finding(status: int | None, body: bytes, plus: Any, minus: Any, how: str) -> Finding | None:
    """None when the checker's answer is simple's sums and differences."""
    import json
    try:
        outputs = {o["name"]: o["data"] for o in json.loads(body)["outputs"]}
        if status == 200 and outputs["OUTPUT0"] == plus.tolist() and outputs["OUTPUT1"] == minus.tolist():
            return None
    except (ValueError, KeyError, TypeError):
        pass
    return Finding("checker", "checker", f"{how}: well-formed simple request got {status} {body[:200]!r}")


def shm_leak(maps: str, tag: str) -> Finding | None:
    key = SHM_KEY.format(tag=tag).lstrip("/")
    if key in maps:
        return Finding("shm", "shm-leak", f"shared memory object '{key}' still mapped after unregistering all")
    return None


# -- HTTP in process ------------------------------------------------------------------------------------------


class InProcessHttp:
    """The real Server and ASGI app in this process, driven on one event loop with httpx's ASGI transport."""

    def __init__(self, workdir: Path, tag: str) -> None:
        self.tag = tag
        self.repo = build_fuzz_repository(workdir / "repo")
        self.files = served_files(self.repo)
        self._stack = ExitStack()
        self._stack.enter_context(shm_object(tag))
        self.server = Server(ServerOptions(repositories=[self.repo], allow_client_shm=True))
        self.server.start()
        self._stack.callback(self.server.close)
        from kiln.frontends.http import build_app
        from kiln.frontends.http.capture import CaptureOptions
        from kiln.frontends.http.files import DownloadOptions
        store = CaptureStore(workdir / "capture", max_bytes=1 << 20)
        app = build_app(self.server, max_input_size=LIMIT, downloads=DownloadOptions(enabled=True),
                        capture=CaptureOptions(store=store))
        self.loop = asyncio.new_event_loop()
        self._stack.callback(self.loop.close)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kiln")
        self._stack.callback(lambda: self.loop.run_until_complete(self.client.aclose()))
        self.rng = random.Random(tag)
        self.answers: list[tuple[HttpCase, Answer]] = []  # of the last run, for the long run's corpus

    def close(self) -> None:
        self._stack.close()

    async def _send(self, case: HttpCase) -> Answer:
        try:
            response = await asyncio.wait_for(self.client.request(
                case.method, case.path, headers=list(case.headers), content=case.body), TIMEOUT_S)
        except asyncio.TimeoutError:
            return Answer(failure="hang")
        except CLIENT_REFUSALS as exc:
            return Answer(status=400, body=f'{{"error": "client refused: {type(exc).__name__}"}}'.encode())
        except Exception as exc:  # out of the app: what the ASGI server would have turned into a 500 or a reset
            return Answer(failure=f"crash: {type(exc).__name__}: {exc}"[:300])
        return Answer(status=response.status_code, body=response.content)

    async def _check(self) -> Finding | None:
        body, plus, minus = checker_request(self.rng)
        answer = await self._send(HttpCase("checker", "POST", "/v2/models/simple/infer", (), body))
        return checker_finding(answer.status, answer.body, plus, minus, "in process, alongside")

    def run(self, case: HttpCase, check: bool = False) -> list[Finding]:
        """Send ``case`` and its steps (with the checker alongside when ``check``); the findings."""
        return self.loop.run_until_complete(self._run(case, check))

    async def _run(self, case: HttpCase, check: bool) -> list[Finding]:
        findings: list[Finding] = []
        self.answers = []
        for step in (case, *case.steps):
            if check:
                answer, checked = await asyncio.gather(self._send(step), self._check())
                findings += [checked] if checked is not None else []
            else:
                answer = await self._send(step)
            self.answers.append((step, answer))
            finding = judge_http(step, answer, self.files)
            findings += [finding] if finding is not None else []
        if case.surface == "shm":
            findings += await self._shm_clean()
        return findings

    async def _shm_clean(self) -> list[Finding]:
        await self._send(HttpCase("shm", "POST", "/v2/systemsharedmemory/unregister"))
        status = await self._send(HttpCase("shm", "GET", "/v2/systemsharedmemory/status"))
        if status.body.strip() not in (b"[]", b""):
            return [Finding("shm", "shm-leak", f"regions listed after unregistering all: {status.body[:200]!r}")]
        leak = shm_leak(Path("/proc/self/maps").read_text(), self.tag)
        return [leak] if leak is not None else []


# -- over the wire --------------------------------------------------------------------------------------------


def serve_args(capture_dir: Path) -> list[str]:
    return ["--allow-client-shm", "true", "--allow-model-download", "--capture-dir", str(capture_dir),
            "--capture-max-mb", "1", "--http-max-input-size", str(LIMIT), "--exit-timeout-secs", "2"]


@contextmanager
def fuzz_server(workdir: Path, tag: str) -> Iterator[KilnProcess]:
    repo = build_fuzz_repository(workdir / "repo")
    with shm_object(tag), kiln_serve([repo], *serve_args(workdir / "capture"),
                                     log_path=workdir / "kiln.log") as server:
        yield server


class WireHttp:
    """HTTP requests to a `kiln serve`: through httpx, and as raw (possibly mangled) request heads on a socket."""

    def __init__(self, server: KilnProcess, repo: Path, tag: str) -> None:
        self.server = server
        self.tag = tag
        self.files = served_files(repo)
        self.client = httpx.Client(base_url=f"http://{server.http_url}", timeout=TIMEOUT_S)
        self.rng = random.Random(tag)
        self.answers: list[tuple[HttpCase, Answer]] = []

    def close(self) -> None:
        self.client.close()

    def send(self, case: HttpCase) -> Answer:
        try:
            response = self.client.request(case.method, case.path, headers=list(case.headers), content=case.body)
        except httpx.TimeoutException:
            return Answer(failure="hang")
        except CLIENT_REFUSALS as exc:
            return Answer(status=400, body=f'{{"error": "client refused: {type(exc).__name__}"}}'.encode())
        except httpx.TransportError as exc:
            return Answer(failure=self._why_gone(exc))
        return Answer(status=response.status_code, body=response.content)

    def _why_gone(self, exc: Exception) -> str:
        code = self.server.process.poll()
        return f"crash: server exited with {code}" if code is not None else \
            f"crash: connection failed: {type(exc).__name__}: {exc}"[:300]

    def run(self, case: HttpCase, check: bool = False) -> list[Finding]:
        findings: list[Finding] = []
        self.answers = []
        for step in (case, *case.steps):
            answer = self.send(step)
            self.answers.append((step, answer))
            finding = judge_http(step, answer, self.files)
            findings += [finding] if finding is not None else []
        if case.surface == "shm":
            findings += self._shm_clean()
        if check:
            findings += self.check()
        return findings

    def check(self) -> list[Finding]:
        body, plus, minus = checker_request(self.rng)
        answer = self.send(HttpCase("checker", "POST", "/v2/models/simple/infer", (), body))
        finding = checker_finding(answer.status, answer.body, plus, minus, f"over HTTP ({answer.failure})")
        return [finding] if finding is not None else []

    def _shm_clean(self) -> list[Finding]:
        self.send(HttpCase("shm", "POST", "/v2/systemsharedmemory/unregister"))
        status = self.send(HttpCase("shm", "GET", "/v2/systemsharedmemory/status"))
        if status.body.strip() not in (b"[]", b""):
            return [Finding("shm", "shm-leak", f"regions listed after unregistering all: {status.body[:200]!r}")]
        leak = shm_leak(Path(f"/proc/{self.server.process.pid}/maps").read_text(), self.tag)
        return [leak] if leak is not None else []

    def raw(self, case: HttpCase, rng: random.Random, check: bool = True) -> list[Finding]:
        """The case as raw HTTP/1.1 bytes, its head sometimes mangled, for uvicorn's parser; then the checker
        (a parser that lost its footing must not take the server down)."""
        head = f"{case.method} {case.path} HTTP/1.1\r\nHost: kiln\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in case.headers)
        data = head.encode("utf-8", "replace") + f"content-length: {len(case.body)}\r\n\r\n".encode() + case.body
        if rng.random() < 0.7:
            cut = data.index(b"\r\n\r\n") + 4
            data = mutate_bytes(rng, data[:cut]) + data[cut:]
        status = _raw_exchange(self.server.http_url, data)
        self.answers = [(HttpCase("http_raw", "RAW", case.path, (), data), Answer(
            status=int(status) if status.isdigit() else None, body=status.encode()))]
        findings: list[Finding] = []
        if status == "hang" or (status.isdigit() and int(status) >= 500 and int(status) != 501):
            findings.append(Finding("http_raw", "hang" if status == "hang" else "5xx",
                                    f"raw request {data[:80]!r}: {status}"))
        return findings + (self.check() if check else [])


def _raw_exchange(address: str, data: bytes) -> str:
    """The status code of the answer to ``data``, 'closed' when the server closed without one, 'hang' when none
    came in time."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            reply = sock.recv(64)
        except TimeoutError:
            return "hang"
        except (ConnectionResetError, BrokenPipeError):
            return "closed"
    parts = reply.split(b" ", 2)
    return parts[1].decode("ascii", "replace") if reply.startswith(b"HTTP/") and len(parts) > 1 else "closed"


class Grpc:
    """Raw request bytes on a gRPC channel (no serializer), unary and streaming."""

    def __init__(self, server: KilnProcess, tag: str) -> None:
        self.server = server
        self.tag = tag
        self.channel = grpc.insecure_channel(server.grpc_url)
        self.rng = random.Random(tag)
        self.last: Answer = Answer()

    def close(self) -> None:
        self.channel.close()

    def send(self, case: GrpcCase) -> Answer:
        try:
            if case.method.endswith("/ModelStreamInfer"):
                call = self.channel.stream_stream(case.method)
                replies = list(call(iter(case.payloads), timeout=TIMEOUT_S))
                errors = tuple(_stream_error(r) for r in replies)
                return Answer(grpc_code="OK", stream_errors=tuple(e for e in errors if e))
            self.channel.unary_unary(case.method)(case.payloads[0], timeout=TIMEOUT_S)
            return Answer(grpc_code="OK")
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return Answer(failure="hang")
            if code == grpc.StatusCode.UNAVAILABLE and self.server.process.poll() is not None:
                return Answer(failure=f"crash: server exited with {self.server.process.poll()}")
            return Answer(grpc_code=code.name, body=(exc.details() or "").encode())

    def run(self, case: GrpcCase, check: bool = False) -> list[Finding]:
        self.last = self.send(case)
        finding = judge_grpc(case, self.last)
        findings = [finding] if finding is not None else []
        return findings + (self.check() if check else [])

    def check(self) -> list[Finding]:
        a = np.asarray([self.rng.randint(-1000, 1000) for _ in range(WIDTH)], np.int32)
        b = np.asarray([self.rng.randint(-1000, 1000) for _ in range(WIDTH)], np.int32)
        request = pb.ModelInferRequest(model_name="simple")
        for name in ("INPUT0", "INPUT1"):
            request.inputs.add(name=name, datatype="INT32", shape=[1, WIDTH])
        request.raw_input_contents.extend([a.tobytes(), b.tobytes()])
        try:
            reply = self.channel.unary_unary(GRPC_INFER)(request.SerializeToString(), timeout=TIMEOUT_S)
            response = pb.ModelInferResponse.FromString(reply)
            names = [o.name for o in response.outputs]
            got = {n: np.frombuffer(raw, np.int32).tolist()
                   for n, raw in zip(names, response.raw_output_contents, strict=False)}
            if got.get("OUTPUT0") == (a + b).tolist() and got.get("OUTPUT1") == (a - b).tolist():
                return []
            detail = f"got {got}"
        except grpc.RpcError as exc:
            detail = f"{exc.code().name} {exc.details()}"
        return [Finding("checker", "checker", f"over gRPC: well-formed simple request: {detail}"[:300])]


def _stream_error(reply: bytes) -> str:
    try:
        return pb.ModelStreamInferResponse.FromString(reply).error_message
    except Exception:
        return "internal error: unreadable stream reply"


# -- config.pbtxt and repository layouts ----------------------------------------------------------------------


def run_config(case: ConfigCase, workdir: Path) -> list[Finding]:
    """The parser, and for a layout the repository scan and model-folder reader, may raise kiln's typed errors
    only."""
    try:
        parse_config_text(case.text)
    except KilnError:
        pass
    except Exception as exc:
        return [Finding(case.surface, "crash", f"parse_config_text: {type(exc).__name__}: {exc}"[:300])]
    if case.surface != "layout":
        return []
    root = Path(tempfile.mkdtemp(dir=workdir))
    try:
        model = root / "m"
        model.mkdir()
        if "config.pbtxt" not in case.files:
            (model / "config.pbtxt").write_text(case.text, encoding="utf-8", errors="replace")
        _lay_out(model, case.files)
        try:
            scan = scan_repositories([root])
            for folder in scan.models.values():
                open_model_dir(folder)
        except KilnError:
            pass
        except Exception as exc:
            return [Finding(case.surface, "crash", f"repository read: {type(exc).__name__}: {exc}"[:300])]
        return []
    finally:
        shutil.rmtree(root, ignore_errors=True)


def config_outcome(text: str) -> str:
    """The parser's answer to ``text`` as a class: 'ok', or the error's type and message shape."""
    try:
        parse_config_text(text)
    except Exception as exc:
        shape = re.sub(r"'[^']*'|\"[^\"]*\"|\d+", "_", str(exc).removeprefix("config.pbtxt: "))
        return f"{type(exc).__name__}: {shape[:70]}"
    return "ok"


def _lay_out(model: Path, files: dict[str, bytes | str | None]) -> None:
    for relative, content in files.items():
        path = model / relative
        if path.exists() or path.is_symlink() or not path.parent.is_dir():
            continue  # taken by an earlier entry, or under a file or link one made
        if content is None:
            path.mkdir()
        elif isinstance(content, str):
            os.symlink(content[2:], path)
        else:
            path.write_bytes(content)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]
