"""Run the Server behind its frontends: HTTP, gRPC and metrics in one event loop, with a graceful drain.

SIGINT/SIGTERM: stop accepting connections, let in-flight requests finish for up to ``exit_timeout_s``, unload the
models, exit 0. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import ssl
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kiln.frontends.grpc.server import start_grpc_server
from kiln.frontends.grpc.workers import start_grpc_workers
from kiln.frontends.http import listener
from kiln.frontends.http.app import build_app
from kiln.frontends.http.capture import CaptureOptions
from kiln.frontends.http.files import DownloadOptions
from kiln.frontends.metrics import METRICS_CONTENT_TYPE, MetricsOptions, metrics_registry, render_metrics
from kiln.server.capture import CaptureStore
from kiln.server.server import Server
from kiln.service_options import ServiceOptions

log = logging.getLogger("kiln.service")


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling (the service owns signals for all its frontends) and with kiln's
    listener, which accepts connections in bursts (frontends/http/listener.py)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        config = self.config
        try:
            bound = listener.bind(config.host, config.port, config.backlog)
        except OSError as exc:
            log.error("cannot listen on %s:%d: %s", config.host, config.port, exc)
            raise SystemExit(1) from None
        await super().startup(sockets=[])  # uvicorn's state, without a server of its own
        self.servers.append(listener.Listener(bound, self._protocol, config.ssl,  # type: ignore[arg-type]
                                              burst=config.backlog))

    def _protocol(self) -> asyncio.Protocol:
        return self.config.http_protocol_class(config=self.config, server_state=self.server_state,  # type: ignore[call-arg]
                                               app_state=self.lifespan.state)


class Service:
    def __init__(self, options: ServiceOptions) -> None:
        self.options = options
        self.server = Server(options.server)
        self._stop = asyncio.Event()
        self._signals = 0
        self.bound: dict[str, int] = {}

    async def run(self) -> int:
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        failed = await loop.run_in_executor(None, self.server.start)
        # Models and frameworks are loaded: move their objects out of the collector's way, so full collections
        # stay short while requests are being served (they otherwise show up as latency spikes).
        gc.collect()
        gc.freeze()
        if failed and self.options.exit_on_error:
            self._log_models()
            log.error("exiting: model(s) %s failed to load (--exit-on-error=true; pass --exit-on-error=false to "
                      "serve the others)", ", ".join(failed))
            await loop.run_in_executor(None, self.server.close)
            return 1
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        http = self._uvicorn(build_app(self.server, max_input_size=self.options.http_max_input_size,
                                       downloads=DownloadOptions(self.options.allow_model_download,
                                                                 self.options.api_key),
                                       capture=self._capture_options()),
                             self.options.http_port, tls=True) if self.options.allow_http else None
        metrics = self._uvicorn(_metrics_app(self.server, self.options.metrics), self.options.metrics_port) \
            if self.options.allow_metrics else None
        grpc_server = None
        if self.options.allow_grpc and self.options.grpc_workers:
            grpc_server, self.bound["grpc"] = await start_grpc_workers(
                self.server, self.options.host, self.options.grpc_port, self.options.grpc_workers,
                max_message_bytes=self.options.grpc_max_message_bytes, grace_s=self.options.exit_timeout_s)
        elif self.options.allow_grpc:
            grpc_server, self.bound["grpc"] = await start_grpc_server(
                self.server, self.options.host, self.options.grpc_port,
                max_message_bytes=self.options.grpc_max_message_bytes)
        # HTTP starts last: its readiness endpoint answering means every frontend listens (gRPC workers take a
        # moment to start).
        tasks = [asyncio.create_task(u.serve()) for u in (http, metrics) if u is not None]
        await _wait_started([u for u in (http, metrics) if u is not None], tasks)
        self._record_ports(http, metrics)
        self._log_startup(time.monotonic() - started)
        watcher = asyncio.create_task(self._poll()) if self.options.server.control_mode == "poll" else None
        await self._stop.wait()
        if watcher is not None:
            watcher.cancel()
        await self._drain(http, metrics, grpc_server, tasks)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        return 0

    def request_stop(self) -> None:
        """What SIGTERM does: stop accepting, drain, exit."""
        self._on_signal(signal.SIGTERM)

    async def _poll(self) -> None:
        """Poll mode: apply repository changes every --repository-poll-secs, off the event loop."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.options.repository_poll_secs)
            try:
                changed = await loop.run_in_executor(None, self.server.poll)
            except Exception:  # a scan error must not stop polling; it is retried next time
                log.exception("repository poll failed")
                continue
            if changed:
                log.info("repository poll applied changes to: %s", ", ".join(changed))

    def _uvicorn(self, app: Any, port: int, *, tls: bool = False) -> _Uvicorn:
        config = uvicorn.Config(app, host=self.options.host, port=port, log_level="warning", access_log=False,
                                lifespan="off", http="httptools", loop="none",
                                timeout_graceful_shutdown=int(self.options.exit_timeout_s),
                                **(self._tls_settings() if tls else {}))
        return _Uvicorn(config)

    def _tls_settings(self) -> dict[str, Any]:
        """uvicorn's TLS settings for the HTTP frontend: none without a certificate."""
        options = self.options
        if options.https_certfile is None:
            return {}
        settings: dict[str, Any] = {"ssl_certfile": str(options.https_certfile),
                                    "ssl_keyfile": str(options.https_keyfile) if options.https_keyfile else None}
        if options.https_client_ca is not None:
            settings |= {"ssl_ca_certs": str(options.https_client_ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}
        return settings

    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning("second signal: exiting now")
            os._exit(1)
        log.info("received %s: draining in-flight requests (up to %ss)", signal.Signals(sig).name,
                 self.options.exit_timeout_s)
        self._stop.set()

    async def _drain(self, http: _Uvicorn | None, metrics: _Uvicorn | None, grpc_server: Any,
                     tasks: list[asyncio.Task[None]]) -> None:
        self.server.begin_shutdown()
        for frontend in (http, metrics):
            if frontend is not None:
                frontend.should_exit = True
        if grpc_server is not None:
            await grpc_server.stop(grace=self.options.exit_timeout_s)
        deadline = time.monotonic() + self.options.exit_timeout_s
        while self.server.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks, return_exceptions=True)
        remaining = max(0.0, deadline - time.monotonic())
        await asyncio.get_running_loop().run_in_executor(None, self.server.close, remaining)
        log.info("stopped")

    def _record_ports(self, http: _Uvicorn | None, metrics: _Uvicorn | None) -> None:
        for name, frontend in (("http", http), ("metrics", metrics)):
            if frontend is not None and frontend.servers:
                self.bound[name] = frontend.servers[0].sockets[0].getsockname()[1]

    def _capture_options(self) -> CaptureOptions:
        if self.options.capture_dir is None:
            return CaptureOptions(api_key=self.options.api_key)
        store = CaptureStore(self.options.capture_dir, self.options.capture_max_bytes)
        log.info("capturing edge samples into %s (at most %d MiB)", self.options.capture_dir,
                 self.options.capture_max_mb)
        return CaptureOptions(store, self.options.api_key)

    def _log_models(self) -> None:
        rows = self.server.repository_index()
        width = max([len(r.name) for r in rows] + [5])
        lines = [f"{'model':<{width}}  version  state        reason"]
        lines += [f"{r.name:<{width}}  {r.version or '-':<7}  {r.state:<11}  {r.reason}" for r in rows]
        log.info("models:\n%s", "\n".join(lines))

    def _log_startup(self, elapsed_s: float) -> None:
        self._log_models()
        host = self.options.host
        http_scheme = "https" if self.options.https_certfile is not None else "http"
        workers = self.options.grpc_workers
        notes = {"metrics": "/metrics", "grpc": f" ({workers} worker process{'es' if workers > 1 else ''})"
                 if workers else ""}
        for name, scheme in (("http", http_scheme), ("grpc", "grpc"), ("metrics", "http")):
            if name in self.bound:
                log.info("%s: %s://%s:%d%s", name, scheme, host, self.bound[name], notes.get(name, ""))
        log.info("ready in %.2fs", elapsed_s)


async def _wait_started(servers: list[_Uvicorn], tasks: list[asyncio.Task[None]]) -> None:
    while not all(s.started for s in servers):
        for task in tasks:
            if task.done():
                task.result()  # re-raise a bind failure
                raise SystemExit(1)
        await asyncio.sleep(0.01)


def _metrics_app(server: Server, options: MetricsOptions) -> Starlette:
    registry = metrics_registry(server, options)

    async def metrics(request: Request) -> Response:
        return Response(render_metrics(registry), media_type=METRICS_CONTENT_TYPE)

    return Starlette(routes=[Route("/metrics", metrics)])


def run_service(options: ServiceOptions) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(Service(options).run())
    return uvloop.run(Service(options).run())
