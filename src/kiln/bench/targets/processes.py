"""Load from several client processes (``--client-processes N``, http and grpc targets).

One Python process can only encode, send and decode so many requests: with large tensors (a 602 KB image) kiln
bench's own client, not the server, is what a served row measures. Here the parent opens the target as usual (it
starts ``kiln serve`` when there is no URL, sends the check request and reads the server's statistics), and N
worker processes, started once with the spawn method, each drive a share of every level's concurrency against
the same URL. Workers send their request records back in small batches; the parent adds them to the level's
recorder, so measurement windows, stability and statistics work as with one process. Records carry
CLOCK_MONOTONIC times, which every process of the machine shares.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading
from multiprocessing.connection import Connection
from typing import Any

from kiln.bench.data import ModelInputs, Request
from kiln.bench.options import BenchOptions
from kiln.bench.records import Level, Recorder, RequestRecord
from kiln.bench.schedule import SendCounts
from kiln.bench.server_stats import ServerCounters
from kiln.bench.targets.base import STOP_TIMEOUT_S, Target
from kiln.errors import UnavailableError

FLUSH_S = 0.02  # how often a worker sends its records: a window boundary may shift a record by this much
START_TIMEOUT_S = 120.0  # a worker imports kiln and the client library, then sends its own check request


class ProcessesTarget(Target):
    """``inner`` (an http or grpc target) opened here, its load driven from ``processes`` worker processes."""

    def __init__(self, options: BenchOptions, inner: Target, processes: int) -> None:
        super().__init__(options.model)
        self.kind = inner.kind
        self._options = options
        self._inner = inner
        self._processes = processes
        self._workers: list[_Worker] = []
        self._active: list[_Worker] = []
        self.records_per_process: list[int] = []  # records each worker has sent, over every level so far

    def open(self) -> ModelInputs:
        model = self._inner.open()
        self.url = self._inner.url
        return model

    def prepare(self, requests: list[Request]) -> None:
        self._inner.prepare(requests)
        self.requests = requests
        options = dataclasses.replace(self._options, url=self.url, client_processes=1, model_repository=None)
        context = multiprocessing.get_context("spawn")  # the parent has threads: no fork
        self._workers = [_Worker(context, options, requests, index) for index in range(self._processes)]
        self.records_per_process = [0] * self._processes
        for worker in self._workers:
            worker.wait_ready()

    def check(self) -> None:
        self._inner.check()

    def start(self, level: Level, recorder: Recorder) -> None:
        if level.concurrency is None:
            raise UnavailableError("--client-processes drives concurrency levels only")
        shares = _shares(level.concurrency, len(self._workers))
        self._active = []
        for worker, share in zip(self._workers, shares, strict=True):
            if share:
                worker.start(dataclasses.replace(level, concurrency=share), recorder)
                self._active.append(worker)

    def stop(self) -> SendCounts | None:
        for worker in self._active:
            worker.request_stop()
        for worker in self._active:
            self.records_per_process[worker.index] += worker.wait_stopped()
        self._active = []
        return None

    def server_stats(self) -> ServerCounters | None:
        return self._inner.server_stats()

    def process_id(self) -> int | None:
        return self._inner.process_id()

    def close(self) -> None:
        try:
            for worker in self._workers:
                worker.close()
        finally:
            self._workers = []
            self._inner.close()


def _shares(concurrency: int, processes: int) -> list[int]:
    """``concurrency`` split as evenly as possible, the larger shares first."""
    base, extra = divmod(concurrency, processes)
    return [base + (1 if index < extra else 0) for index in range(processes)]


class _Worker:
    """The parent's side of one worker process: a pipe, and a thread that moves its records to the recorder."""

    def __init__(self, context: Any, options: BenchOptions, requests: list[Request], index: int) -> None:
        self.index = index
        self._conn, child = context.Pipe()
        self._process = context.Process(target=worker_main, args=(child, options, requests),
                                        name=f"kiln-bench-client-{index}", daemon=True)
        self._process.start()
        child.close()
        self._recorder: Recorder | None = None
        self._stopped = threading.Event()
        self._count = 0
        self._failure: str | None = None
        self._reader: threading.Thread | None = None

    def wait_ready(self) -> None:
        if not self._conn.poll(START_TIMEOUT_S):
            self.close()
            raise UnavailableError(f"bench client process {self.index} did not start within {START_TIMEOUT_S:.0f} s")
        kind, detail = self._conn.recv()
        if kind != "ready":
            self.close()
            raise UnavailableError(f"bench client process {self.index} failed to start: {detail}")
        self._reader = threading.Thread(target=self._read, name=f"kiln-bench-client-{self.index}-reader",
                                        daemon=True)
        self._reader.start()

    def start(self, level: Level, recorder: Recorder) -> None:
        self._recorder = recorder
        self._stopped.clear()
        self._count = 0
        self._conn.send(("start", level))

    def request_stop(self) -> None:
        self._conn.send(("stop", None))

    def wait_stopped(self) -> int:
        if not self._stopped.wait(STOP_TIMEOUT_S):
            raise UnavailableError(f"bench client process {self.index} did not stop within {STOP_TIMEOUT_S:.0f} s")
        if self._failure is not None:
            raise UnavailableError(f"bench client process {self.index} failed: {self._failure}")
        return self._count

    def close(self) -> None:
        try:
            self._conn.send(("exit", None))
        except (BrokenPipeError, OSError):
            pass
        self._process.join(10.0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5.0)
        self._conn.close()

    def _read(self) -> None:
        while True:
            try:
                kind, payload = self._conn.recv()
            except (EOFError, OSError):
                self._failure = self._failure or "the process ended"
                self._stopped.set()
                return
            if kind == "records" and self._recorder is not None:
                for record in payload:
                    self._recorder.add(record)
                self._count += len(payload)
            elif kind == "stopped":
                self._stopped.set()
            elif kind == "failed":
                self._failure = str(payload)
                self._stopped.set()


class _ForwardingRecorder(Recorder):
    """A worker's recorder: records go to the parent in batches, every FLUSH_S and when the level stops."""

    def __init__(self, conn: Connection, lock: threading.Lock) -> None:
        super().__init__()
        self._conn = conn
        self._send_lock = lock
        self._done = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="kiln-bench-flush", daemon=True)
        self._flusher.start()

    def finish(self) -> None:
        self._done.set()
        self._flusher.join()
        self.flush()

    def flush(self) -> None:
        batch: list[RequestRecord] = self.take_all()
        if batch:
            with self._send_lock:
                self._conn.send(("records", batch))

    def _flush_loop(self) -> None:
        while not self._done.wait(FLUSH_S):
            self.flush()


def worker_main(conn: Connection, options: BenchOptions, requests: list[Request]) -> None:
    """A client process: open the target at the parent's URL, then run the levels the parent sends."""
    from kiln.bench.targets import create_target

    lock = threading.Lock()
    try:
        target = create_target(options)
        target.open()
        target.prepare(requests)
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    try:
        while True:
            kind, level = conn.recv()
            if kind == "exit":
                return
            if kind != "start":
                continue
            recorder = _ForwardingRecorder(conn, lock)
            target.start(level, recorder)
            kind, _ = conn.recv()  # "stop" (or "exit": stop first all the same)
            try:
                target.stop()
            finally:
                recorder.finish()
            with lock:
                conn.send(("stopped", None))
            if kind == "exit":
                return
    except (EOFError, OSError):  # the parent went away
        return
    except Exception as exc:
        with lock:
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
    finally:
        target.close()
