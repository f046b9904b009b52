"""HTTP connection limits and timeouts, and hostile request values, against a real `kiln serve` with HTTP in the
server process and in two HTTP worker processes: oversized heads are answered 431, slow heads 408, slow bodies
and idle connections are closed, the connection cap holds, and a normal client is served throughout."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln.demo import build_demo_repository
from kiln.serve_process import KilnProcess, kiln_serve

TIMEOUT_S = 1.0
MODES = {"in-process": ["--http-workers", "1"], "2 workers": ["--http-workers", "2"]}
SHORT = ["--http-header-timeout-secs", str(TIMEOUT_S), "--http-body-timeout-secs", str(TIMEOUT_S),
         "--http-idle-timeout-secs", str(TIMEOUT_S)]
CAP = 20


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    build_demo_repository(root)
    return root


@pytest.fixture(scope="module", params=list(MODES))
def short(repo: Path, request: pytest.FixtureRequest) -> Iterator[KilnProcess]:
    """Timeouts of one second."""
    with kiln_serve([repo], *MODES[request.param], *SHORT) as process:
        yield process


@pytest.fixture(scope="module", params=list(MODES))
def capped(repo: Path, request: pytest.FixtureRequest) -> Iterator[KilnProcess]:
    """At most CAP connections per process, default timeouts."""
    with kiln_serve([repo], *MODES[request.param], "--http-max-connections", str(CAP)) as process:
        yield process


def _connect(url: str) -> socket.socket:
    host, port = url.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def _until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def _fill_every_process(url: str, processes: int) -> list[socket.socket]:
    """Connections that leave every serving process exactly at the cap (5 x CAP, however the kernel spreads them,
    then those over the cap closed by the server). A connection the server still counted from before (the
    fixture's readiness probe, closed by the client but not yet seen closed) makes a process close one more of
    ours and then have room again: the attempt is repeated once that connection is gone."""
    expected = 5 * CAP - processes * CAP
    for _ in range(3):
        held = [_connect(url) for _ in range(5 * CAP)]
        deadline = time.monotonic() + 20
        while (closed := sum(_closed_by_server(sock) for sock in held)) < expected:
            assert time.monotonic() < deadline, f"{closed} of {len(held)} connections closed by the server in 20 s"
            time.sleep(0.05)
        time.sleep(0.2)  # any more closing would come now
        if sum(_closed_by_server(sock) for sock in held) == expected:
            return held
        for sock in held:
            sock.close()
        time.sleep(0.5)
    raise AssertionError(f"the server never kept exactly {processes} x {CAP} connections open")


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (without reading from it: a connection still open stays untouched)."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except ConnectionResetError:
        return True


def _get(url: str, path: str = "/v2/health/ready") -> bytes:
    with _connect(url) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: kiln\r\nConnection: close\r\n\r\n".encode())
        return _until_closed(sock)


def _post(url: str, path: str, body: bytes, **headers: str) -> tuple[int, dict[str, Any]]:
    lines = "".join(f"{name.replace('_', '-')}: {value}\r\n" for name, value in headers.items())
    with _connect(url) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: kiln\r\nConnection: close\r\nContent-Length: {len(body)}\r\n"
                     f"{lines}\r\n".encode() + body)
        answer = _until_closed(sock)
    head, _, content = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(content)


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def test_oversized_heads_are_answered_431(short: KilnProcess) -> None:
    for head in (b"X-Big: " + b"a" * 2**20 + b"\r\n",  # one header of 1 MiB
                 b"X-Big: " + b"a" * 70_000 + b"\r\n",  # over 64 KiB, in the same read as the rest
                 b"".join(b"X-%d: 1\r\n" % i for i in range(150))):  # 150 header fields
        with _connect(short.http_url) as sock:
            sock.sendall(b"GET /v2 HTTP/1.1\r\nHost: kiln\r\n" + head + b"\r\n")
            answer = _until_closed(sock)
        assert _status(answer) == 431, answer[:200]
    assert _status(_get(short.http_url)) == 200


def test_slow_head_is_closed_while_others_are_served(short: KilnProcess) -> None:
    started = time.monotonic()
    with _connect(short.http_url) as slow:
        slow.sendall(b"GET /v2 HTTP/1.1\r\nHo")  # and no more
        for _ in range(3):
            assert _status(_get(short.http_url)) == 200
        answer = _until_closed(slow)
    waited = time.monotonic() - started
    assert _status(answer) == 408 and b"did not arrive within 1 s" in answer
    assert TIMEOUT_S * 0.8 < waited < TIMEOUT_S + 15


def test_slow_body_is_closed(short: KilnProcess) -> None:
    started = time.monotonic()
    with _connect(short.http_url) as sock:
        sock.sendall(b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: kiln\r\nContent-Length: 100\r\n\r\n{")
        assert _until_closed(sock) == b""
    assert time.monotonic() - started < TIMEOUT_S + 15


def test_idle_connections_are_closed_and_do_not_starve_others(short: KilnProcess) -> None:
    idle = [_connect(short.http_url) for _ in range(200)]
    try:
        assert _status(_get(short.http_url)) == 200
        for sock in idle[:5]:
            assert _status(_until_closed(sock)) == 408  # nothing sent: no head within the timeout
    finally:
        for sock in idle:
            sock.close()
    with _connect(short.http_url) as keep_alive:  # after an answer: closed once idle for the timeout
        keep_alive.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: kiln\r\n\r\n")
        assert _until_closed(keep_alive).startswith(b"HTTP/1.1 200")


def test_connection_cap(capped: KilnProcess, request: pytest.FixtureRequest) -> None:
    processes = max(1, int(MODES[request.node.callspec.params["capped"]][1]))
    held = _fill_every_process(capped.http_url, processes)
    try:
        with _connect(capped.http_url) as refused:
            refused.settimeout(20)  # well before the 30 s head timeout, even on a loaded machine
            assert _until_closed(refused) == b""  # closed when accepted, not answered
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while _get(capped.http_url) == b"" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _status(_get(capped.http_url)) == 200


def _simple(**parameters: Any) -> bytes:
    data = {"datatype": "INT32", "shape": [1, 16], "data": [1] * 16}
    return json.dumps({"inputs": [{"name": "INPUT0", **data}, {"name": "INPUT1", **data}],
                       "parameters": parameters}).encode()


@pytest.mark.parametrize(("key", "value"), [("priority", True), ("priority", -1), ("timeout", -5),
                                          ("sequence_id", 2**70)])
def test_out_of_range_parameters_are_refused(short: KilnProcess, key: str, value: Any) -> None:
    status, answer = _post(short.http_url, "/v2/models/simple/infer", _simple(**{key: value}))
    assert status == 400
    assert f"model 'simple': request parameter '{key}' is " in answer["error"]
    assert "expected an integer 0..18446744073709551615" in answer["error"]
    assert _post(short.http_url, "/v2/models/simple/infer", _simple(priority=0, timeout=0))[0] == 200


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("timeout", "x", "expected an integer"), ("priority", 1.5, "expected an integer"),
    ("priority", 2**64, "expected an integer"), ("sequence_id", None, "or a string"),
    ("sequence_start", 1, "expected true or false"), ("sequence_end", "x", "expected true or false")])
def test_parameters_of_the_wrong_type_are_refused(short: KilnProcess, key: str, value: Any, expected: str) -> None:
    status, answer = _post(short.http_url, "/v2/models/simple/infer", _simple(**{key: value}))
    assert status == 400 and f"request parameter '{key}' is " in answer["error"] and expected in answer["error"]


def test_a_float_beyond_its_type_is_refused_not_cast_to_inf(short: KilnProcess) -> None:
    logits = {"name": "LOGITS", "datatype": "FP32", "shape": [1, 10], "data": [1e308] + [0.0] * 9}
    status, answer = _post(short.http_url, "/v2/models/mlp_postprocess/infer",
                           json.dumps({"inputs": [logits]}).encode())
    assert status == 400 and "holds 1e+308, beyond the FP32 range" in answer["error"], answer
    logits["data"] = [3e38] + [0.0] * 9  # within FP32's range: served
    assert _post(short.http_url, "/v2/models/mlp_postprocess/infer", json.dumps({"inputs": [logits]}).encode()
                 )[0] == 200


def test_an_integer_beyond_fp16_and_a_shape_beyond_any_array_are_refused(short: KilnProcess) -> None:
    item = {"name": "INPUT0", "datatype": "FP16", "shape": [1], "data": [70000]}
    status, answer = _post(short.http_url, "/v2/models/simple/infer", json.dumps({"inputs": [item]}).encode())
    assert status == 400 and "holds 70000, beyond the FP16 range" in answer["error"], answer
    item = {"name": "INPUT0", "datatype": "INT32", "shape": [0, 2**62], "data": []}
    status, answer = _post(short.http_url, "/v2/models/simple/infer", json.dumps({"inputs": [item]}).encode())
    assert status == 400 and "describes more than 1099511627776 elements" in answer["error"], answer


def test_a_body_over_the_limit_to_an_unknown_model_is_not_found(short: KilnProcess) -> None:
    with _connect(short.http_url) as sock:  # the answer comes from the declared length: no need to send 80 MiB
        sock.sendall(f"POST /v2/models/nope/infer HTTP/1.1\r\nHost: kiln\r\nConnection: close\r\n"
                     f"Content-Length: {80 * 2**20}\r\n\r\n".encode() + bytes(4096))
        head, _, content = _until_closed(sock).partition(b"\r\n\r\n")
    assert int(head.split()[1]) == 404 and "nope" in json.loads(content)["error"], (head, content)


def test_unknown_model_is_not_found_before_its_sizes(short: KilnProcess) -> None:
    header = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16],
                                     "parameters": {"binary_data_size": 10 * 2**20}}]}).encode()
    status, answer = _post(short.http_url, "/v2/models/nope/infer", header + bytes(10 * 2**20),
                           Inference_Header_Content_Length=str(len(header)))
    assert status == 404 and "nope" in answer["error"]


def test_unsupported_content_encoding(short: KilnProcess) -> None:
    status, answer = _post(short.http_url, "/v2/models/simple/infer", _simple(), Content_Encoding="br")
    assert status == 400
    assert answer["error"] == ("Content-Encoding 'br' is not supported; send the request body as gzip, deflate "
                               "(zlib), or identity (uncompressed)")
