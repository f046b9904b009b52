"""What the http and grpc targets share: the server address, a ``kiln serve`` started for the run when no URL is
given, and finding the server's process for memory figures."""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from kiln.bench.data import ModelInputs
from kiln.bench.options import BenchOptions
from kiln.bench.targets.aio import AsyncTarget
from kiln.errors import InvalidArgumentError, UnavailableError
from kiln.serve_process import KilnProcess, kiln_serve

log = logging.getLogger("kiln.bench")

LOOPBACK = ("127.0.0.1", "localhost", "::1")
SERVE_READY_TIMEOUT_S = 120.0


def split_url(url: str, default_port: int) -> tuple[str, int]:
    """``host[:port]`` or ``scheme://host[:port][/]`` -> (host, port)."""
    problem = InvalidArgumentError(f"-u/--url is '{url}'; expected host:port, e.g. localhost:{default_port}")
    parsed = urlsplit(url if "://" in url else f"//{url}")
    try:
        port = parsed.port
    except ValueError:
        raise problem from None
    if not parsed.hostname or parsed.path not in ("", "/"):
        raise problem
    return parsed.hostname, port if port is not None else default_port


def listening_pid(host: str, port: int) -> int | None:
    """The local process listening on ``port`` when ``host`` is this machine (psutil; None if not visible)."""
    if host not in LOOPBACK:
        return None
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return int(conn.pid)
    except Exception:  # psutil missing or not allowed to list sockets: memory is simply not measured
        return None
    return None


class RemoteTarget(AsyncTarget):
    """An AsyncTarget that reaches a server over the network, starting ``kiln serve`` when no URL is given."""

    default_port = 8000

    def __init__(self, options: BenchOptions) -> None:
        super().__init__(options.model)
        self.url = options.url
        self.version = options.model_version
        self._repository = options.model_repository
        self._pid = options.server_pid
        # perf_analyzer's system shared memory needs a server that allows client regions.
        self._serve_args = ("--allow-client-shm",) if options.shared_memory != "none" else ()
        self._stack = contextlib.ExitStack()
        self.host, self.port = ("", 0) if self.url is None else split_url(self.url, self.default_port)

    def served_url(self, process: KilnProcess) -> str:
        return process.http_url

    def open(self) -> ModelInputs:
        if self.url is None:
            process = self._start_server()
            self.url = self.served_url(process)
            self.host, self.port = split_url(self.url, self.default_port)
            self._pid = self._pid or process.process.pid
        elif self._pid is None:
            self._pid = listening_pid(self.host, self.port)
        return super().open()

    def _start_server(self) -> KilnProcess:
        assert self._repository is not None  # BenchOptions checks it
        log_dir = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="kiln-bench-serve-")))
        log_path = log_dir / "serve.log"
        try:
            return self._stack.enter_context(kiln_serve(
                [self._repository], "--model-control-mode", "explicit", "--load-model", self.model, *self._serve_args,
                log_path=log_path, ready_timeout_s=SERVE_READY_TIMEOUT_S))
        except (RuntimeError, TimeoutError) as exc:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
            self._stack.close()
            raise UnavailableError(f"kiln bench could not start `kiln serve` for model '{self.model}': {exc}\n"
                                   f"{tail}") from None

    def process_id(self) -> int | None:
        return self._pid

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._stack.close()
