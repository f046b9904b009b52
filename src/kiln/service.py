"""Run the Server behind its frontends: HTTP, gRPC and metrics in one event loop, with a graceful drain.

SIGINT/SIGTERM: stop accepting connections, let in-flight requests finish for up to ``exit_timeout_s``, unload the
models, exit 0. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kiln.compile_workers import stop_compile_workers
from kiln.console import ConsoleOptions
from kiln.frontends.grpc.access import GrpcTls
from kiln.frontends.grpc.server import GrpcConnectionLimits, start_grpc_server
from kiln.frontends.grpc.workers import start_grpc_workers
from kiln.frontends.handoff.supervisor import WorkerPool
from kiln.frontends.http.app import build_app
from kiln.frontends.http.capture import CaptureOptions
from kiln.frontends.http.files import DownloadOptions
from kiln.frontends.http.infer_lane import InferLane, ServerCore, lane_enabled
from kiln.frontends.http.server import HttpServer, http_config
from kiln.frontends.http.workers import HttpWorkers, WorkerSettings
from kiln.frontends.metrics import METRICS_CONTENT_TYPE, MetricsOptions, metrics_registry, render_metrics
from kiln.frontends.metrics_processes import Processes, WatchedProcess
from kiln.heap import keep_freed_heap
from kiln.server.capture import CaptureStore
from kiln.server.server import Server
from kiln.service_options import ServiceOptions

log = logging.getLogger("kiln.service")


class Service:
    def __init__(self, options: ServiceOptions) -> None:
        self.options = options
        self.server = Server(options.server)
        self._stop = asyncio.Event()
        self._signals = 0
        self.bound: dict[str, int] = {}
        self.grpc_tls: GrpcTls | None = None
        self._loop_thread = 0  # the native id of the thread running the event loop, once run() runs
        self._pools: list[tuple[str, WorkerPool]] = []  # ("http_worker", its pool), ...: their processes' metrics
        self._http_workers: HttpWorkers | None = None  # for their connection counts

    async def run(self) -> int:
        started = time.monotonic()
        self._loop_thread = threading.get_native_id()
        self.grpc_tls = self.options.grpc_tls  # bad certificates fail here, before any model loads
        loop = asyncio.get_running_loop()
        failed = await loop.run_in_executor(None, self.server.start)
        stopping = time.monotonic()
        if await loop.run_in_executor(None, stop_compile_workers):  # nothing compiles until the next load
            log.info("stopped torch.compile's compile workers (the models are loaded) in %.1f s",
                     time.monotonic() - stopping)
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
        in_process_http = self.options.allow_http and self.options.http_workers <= 1
        http = self._uvicorn(self._http_app(), self.options.http_port, frontend=True) if in_process_http else None
        metrics = self._uvicorn(_metrics_app(self.server, self.options.metrics, self._processes),
                                self.options.metrics_port) if self.options.allow_metrics else None
        self.server.hold_readiness(True)  # until every frontend listens
        grpc_server = None
        if self.options.allow_grpc and self.options.grpc_workers:
            grpc_server, self.bound["grpc"] = await start_grpc_workers(
                self.server, self.options.host, self.options.grpc_port, self.options.grpc_workers,
                max_message_bytes=self.options.grpc_max_message_bytes, grace_s=self.options.exit_timeout_s,
                access=self.options.grpc_access, tls=self.grpc_tls, limits=self._grpc_limits())
            self._pools.append(("grpc_worker", grpc_server.pool))
        elif self.options.allow_grpc:
            grpc_server, self.bound["grpc"] = await start_grpc_server(
                self.server, self.options.host, self.options.grpc_port,
                max_message_bytes=self.options.grpc_max_message_bytes, access=self.options.grpc_access,
                tls=self.grpc_tls, limits=self._grpc_limits())
        tasks = [asyncio.create_task(u.serve()) for u in (http, metrics) if u is not None]
        await _wait_started([u for u in (http, metrics) if u is not None], tasks)
        self._record_ports(http, metrics)
        http_workers = await self._start_http_workers() if self.options.allow_http and not in_process_http else None
        self.server.hold_readiness(False)
        self._log_startup(time.monotonic() - started)
        watcher = asyncio.create_task(self._poll()) if self.options.server.control_mode == "poll" else None
        await self._stop.wait()
        if watcher is not None:
            watcher.cancel()
        await self._drain(http, metrics, [w for w in (grpc_server, http_workers) if w is not None], tasks)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        return 0

    def _processes(self) -> Iterator[WatchedProcess]:
        """This process and its frontend workers, for the metrics of their CPU time; each worker's event loop runs
        on its main thread."""
        yield WatchedProcess("server", os.getpid(), self._loop_thread)
        for prefix, pool in self._pools:
            held = self._http_workers.connections() if prefix == "http_worker" and self._http_workers else None
            for index, process in enumerate(pool.processes):
                if process.returncode is None:
                    yield WatchedProcess(f"{prefix}_{index}", process.pid, process.pid,
                                         None if held is None else held[index])

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

    def _http_app(self) -> Any:
        capture = self._capture_options()
        return build_app(self.server, max_input_size=self.options.http_max_input_size,
                         downloads=DownloadOptions(self.options.allow_model_download, self.options.api_key),
                         capture=capture, access=self.options.http_access,
                         console=self._console_options(capture.store))

    def _uvicorn(self, app: Any, port: int, *, frontend: bool = False) -> HttpServer:
        """uvicorn serving ``app`` on ``port``; the HTTP frontend (``frontend``) with its TLS and infer lane."""
        options = self.options
        limits = options.http_limits
        if not frontend:
            return HttpServer(http_config(app, options.host, port, options.exit_timeout_s, limits=limits))
        lane = InferLane(ServerCore(self.server), options.http_max_input_size, options.http_access) \
            if lane_enabled() else None
        return HttpServer(http_config(app, options.host, port, options.exit_timeout_s,
                                      certfile=options.https_certfile, keyfile=options.https_keyfile,
                                      client_ca=options.https_client_ca, limits=limits, lane=lane))

    def _grpc_limits(self) -> GrpcConnectionLimits:
        return GrpcConnectionLimits(self.options.grpc_keepalive_s, self.options.grpc_max_connection_idle_s)

    async def _start_http_workers(self) -> HttpWorkers:
        """HTTP from worker processes (--http-workers N > 1); they serve the same app through this process."""
        options = self.options
        settings = WorkerSettings(options.host, options.http_port, options.http_workers, options.http_max_input_size,
                                  options.exit_timeout_s, options.https_certfile, options.https_keyfile,
                                  options.https_client_ca, log_level="DEBUG" if options.log_verbose else "INFO",
                                  access=options.http_access, limits=options.http_limits)
        workers = HttpWorkers(self.server, self._http_app(), settings)
        # Known before they start, so that the metrics list each worker from its first moment.
        self._pools.append(("http_worker", workers.pool))
        self._http_workers = workers
        try:
            self.bound["http"] = await workers.start()
        except OSError as exc:
            log.error("cannot serve HTTP on %s:%d: %s", options.host, options.http_port, exc)
            raise SystemExit(1) from None
        return workers

    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning("second signal: exiting now")
            os._exit(1)
        log.info("received %s: draining in-flight requests (up to %ss)", signal.Signals(sig).name,
                 self.options.exit_timeout_s)
        self._stop.set()

    async def _drain(self, http: HttpServer | None, metrics: HttpServer | None, workers: list[Any],
                     tasks: list[asyncio.Task[None]]) -> None:
        self.server.begin_shutdown()
        for frontend in (http, metrics):
            if frontend is not None:
                frontend.should_exit = True
        # Worker processes (gRPC, HTTP) drain together; this process answers their requests meanwhile.
        await asyncio.gather(*(w.stop(grace=self.options.exit_timeout_s) for w in workers))
        deadline = time.monotonic() + self.options.exit_timeout_s
        while self.server.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks, return_exceptions=True)
        remaining = max(0.0, deadline - time.monotonic())
        await asyncio.get_running_loop().run_in_executor(None, self.server.close, remaining)
        log.info("stopped")

    def _record_ports(self, http: HttpServer | None, metrics: HttpServer | None) -> None:
        for name, frontend in (("http", http), ("metrics", metrics)):
            if frontend is not None and frontend.servers:
                self.bound[name] = frontend.servers[0].sockets[0].getsockname()[1]

    def _console_options(self, captures: CaptureStore | None) -> ConsoleOptions:
        options = self.options
        report = options.console_report
        if report is not None and not report.is_dir():  # a file of the report: its folder
            report = report.parent
        return ConsoleOptions(options.allow_console, options.allow_model_download, options.api_key is not None,
                              report, captures)

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
        notes = {"metrics": "/metrics", "grpc": _workers_note(self.options.grpc_workers),
                 "http": _workers_note(self.options.http_workers if self.options.http_workers > 1 else 0)}
        grpc_scheme = "grpcs" if self.grpc_tls is not None else "grpc"
        for name, scheme in (("http", http_scheme), ("grpc", grpc_scheme), ("metrics", "http")):
            if name in self.bound:
                log.info("%s: %s://%s:%d%s", name, scheme, host, self.bound[name], notes.get(name, ""))
        for name, policy in (("http", self.options.http_access), ("grpc", self.options.grpc_access)):
            if policy and name in self.bound:
                log.info("%s: restricted API groups: %s", name, policy.describe())
        log.info("ready in %.2fs", elapsed_s)


def _workers_note(count: int) -> str:
    return f" ({count} worker process{'es' if count > 1 else ''})" if count else ""


async def _wait_started(servers: list[HttpServer], tasks: list[asyncio.Task[None]]) -> None:
    while not all(s.started for s in servers):
        for task in tasks:
            if task.done():
                task.result()  # re-raise a bind failure
                raise SystemExit(1)
        await asyncio.sleep(0.01)


def _metrics_app(server: Server, options: MetricsOptions, processes: Processes) -> Starlette:
    registry = metrics_registry(server, options, processes)

    async def metrics(request: Request) -> Response:
        return Response(render_metrics(registry), media_type=METRICS_CONTENT_TYPE)

    return Starlette(routes=[Route("/metrics", metrics)])


def run_service(options: ServiceOptions) -> int:
    keep_freed_heap()
    try:
        import uvloop
    except ImportError:
        return asyncio.run(Service(options).run())
    return uvloop.run(Service(options).run())
