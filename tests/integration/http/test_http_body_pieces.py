"""A request body read however it arrives: in one piece, in pieces a loop turn or more apart, or chunked, with
binary tensors, on a real `kiln serve` with HTTP in the server process and in two HTTP worker processes."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kiln.demo import build_demo_repository
from kiln.serve_process import KilnProcess, kiln_serve

MODES = {"in-process": ["--http-workers", "1"], "2 workers": ["--http-workers", "2"]}


@pytest.fixture(scope="module", params=list(MODES))
def served(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[KilnProcess]:
    root = tmp_path_factory.mktemp("repo")
    build_demo_repository(root)
    with kiln_serve([root], *MODES[request.param]) as process:
        yield process


def _body(first: np.ndarray, second: np.ndarray) -> tuple[bytes, int]:
    """A binary-tensor infer body for `simple` and its JSON header's length."""
    header = json.dumps({"inputs": [
        {"name": name, "datatype": "INT32", "shape": [1, 16], "parameters": {"binary_data_size": 64}}
        for name in ("INPUT0", "INPUT1")], "outputs": [{"name": "OUTPUT0"}, {"name": "OUTPUT1"}]}).encode()
    return header + first.tobytes() + second.tobytes(), len(header)


def _exchange(url: str, head: bytes, pieces: list[bytes]) -> tuple[int, dict[str, object]]:
    host, port = url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(head)
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(0.02)  # each piece reaches the server on its own
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_head, _, content = answer.partition(b"\r\n\r\n")
    return int(status_head.split()[1]), json.loads(content)


def _head(length: int | None, json_size: int, chunked: bool = False) -> bytes:
    framing = "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {length}\r\n"
    return (f"POST /v2/models/simple/infer HTTP/1.1\r\nHost: kiln\r\nConnection: close\r\n{framing}"
            f"Inference-Header-Content-Length: {json_size}\r\n\r\n").encode()


def _check(status: int, answer: dict[str, object], first: np.ndarray, second: np.ndarray) -> None:
    assert status == 200, answer
    outputs = {o["name"]: o["data"] for o in answer["outputs"]}  # type: ignore[attr-defined]
    assert outputs["OUTPUT0"] == (first + second).ravel().tolist()
    assert outputs["OUTPUT1"] == (first - second).ravel().tolist()


@pytest.mark.parametrize("cuts", [[], [1], [7, 90], [50, 51, 52, 150]], ids=["whole", "1", "7,90", "4 cuts"])
def test_a_body_in_pieces_is_read_whole(served: KilnProcess, cuts: list[int]) -> None:
    rng = np.random.default_rng(len(cuts))
    first, second = (rng.integers(-1000, 1000, (1, 16), dtype=np.int32) for _ in range(2))
    body, json_size = _body(first, second)
    bounds = [0, *cuts, len(body)]
    pieces = [body[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    # The binary outputs are not asked for: the answer is JSON, easy to compare.
    _check(*_exchange(served.http_url, _head(len(body), json_size), pieces), first, second)


def test_a_chunked_body_is_read_whole(served: KilnProcess) -> None:
    first, second = np.arange(16, dtype=np.int32).reshape(1, 16), np.full((1, 16), 3, np.int32)
    body, json_size = _body(first, second)
    pieces = [b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:40], body[40:100], body[100:])] + [b"0\r\n\r\n"]
    _check(*_exchange(served.http_url, _head(None, json_size, chunked=True), pieces), first, second)
