"""Run `kiln serve` as a child process on free ports: what `kiln bench` (the remote target, `compare`) and the
tests and benchmarks start when they need a real server."""

from __future__ import annotations

import contextlib
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kiln.v2.client import HttpClient, ServerUnreachableError


@dataclass(frozen=True)
class KilnProcess:
    """A running `kiln serve`: ``host:port`` addresses of its frontends, as tritonclient takes them."""

    http_url: str
    grpc_url: str
    metrics_url: str
    process: subprocess.Popen[bytes]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(http_url: str, process: subprocess.Popen[bytes], timeout_s: float = 60.0, *,
               context: ssl.SSLContext | None = None) -> None:
    """Poll ``/v2/health/ready`` (over https with ``context``, e.g. a server started with --https-certfile)."""
    scheme = "https" if context is not None else "http"
    deadline = time.monotonic() + timeout_s
    with HttpClient(f"{scheme}://{http_url}", timeout_s=1.0, tls=context) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"kiln serve exited with status {process.returncode} before it was ready")
            try:
                if client.ready():
                    return
            except ServerUnreachableError:  # not listening yet
                pass
            time.sleep(0.05)
    raise TimeoutError(f"kiln serve was not ready within {timeout_s}s")


PORT_TRIES = 3
"""Starts of `kiln serve` on fresh ports when one of the free ports picked was taken before the server bound it."""


class ServeFailed(RuntimeError):
    """`kiln serve` exited before it was ready; the message ends with the last lines it printed."""

    def __init__(self, status: int, log_tail: str) -> None:
        super().__init__(f"kiln serve exited with status {status} before it was ready; its last output:\n{log_tail}")
        self.port_taken = "Address already in use" in log_tail or "address in use" in log_tail


@contextlib.contextmanager
def kiln_serve(repositories: Sequence[Path], *extra_args: str, log_path: Path | None = None,
               ready_timeout_s: float = 60.0, context: ssl.SSLContext | None = None) -> Iterator[KilnProcess]:
    """Start `kiln serve` on free ports, wait until it is ready, and stop it (SIGTERM, then kill) on exit. Pass
    ``context`` when ``extra_args`` turn on https, so that readiness is polled over TLS. Its output goes to
    ``log_path`` (a temporary file without one); a server that exits before it is ready raises :class:`ServeFailed`
    with the end of that output, after up to ``PORT_TRIES`` starts where another process took a port first."""
    for attempt in range(1, PORT_TRIES + 1):
        with contextlib.ExitStack() as stack:
            log = (stack.enter_context(open(log_path, "w+b")) if log_path is not None
                   else stack.enter_context(tempfile.TemporaryFile()))
            try:
                started = stack.enter_context(_started(repositories, extra_args, log, ready_timeout_s, context))
            except ServeFailed as failed:
                if failed.port_taken and attempt < PORT_TRIES:
                    continue
                raise
            yield started
            return


@contextlib.contextmanager
def _started(repositories: Sequence[Path], extra_args: Sequence[str], log: IO[bytes], ready_timeout_s: float,
             context: ssl.SSLContext | None) -> Iterator[KilnProcess]:
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    command = [sys.executable, "-m", "kiln.cli", "serve", "--http-port", str(http_port),
               "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port)]
    for repository in repositories:
        command += ["--model-repository", str(repository)]
    command += list(extra_args)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            wait_ready(f"127.0.0.1:{http_port}", process, ready_timeout_s, context=context)
        except RuntimeError:
            if process.poll() is None:
                raise
            raise ServeFailed(process.returncode, _tail(log)) from None
        yield KilnProcess(f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", f"127.0.0.1:{metrics_port}", process)
    finally:
        stop(process)


def _tail(log: IO[bytes], lines: int = 20) -> str:
    log.flush()
    log.seek(0)
    return "\n".join(log.read().decode(errors="replace").splitlines()[-lines:])


def stop(process: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    """SIGTERM (a clean shutdown), then kill after ``timeout_s``."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
