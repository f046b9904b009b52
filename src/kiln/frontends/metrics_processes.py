"""CPU time of `kiln serve`'s processes and of their event loops: ``kiln_process_cpu_seconds`` and
``kiln_event_loop_cpu_seconds``, one sample per process (``server``, ``http_worker_0``, ``grpc_worker_1``, ...);
and ``kiln_http_worker_connections``, the HTTP connections each HTTP worker holds (they are dealt to the worker
holding the fewest: frontends/http/shares.py).

Every request passes through the server process's event loop, and through a frontend worker's when there are
workers. A loop that uses about one second of CPU per second cannot go faster, however idle the machine's other
cores are; the process's own figure says how much of its time went to other threads (staging copies, the thread
that waits for the GPU). Read when Prometheus scrapes (psutil: /proc on Linux), so requests pay nothing for them. A
worker that died and was replaced starts again from zero, which Prometheus' ``rate()`` reads as a counter reset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import psutil
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

PROCESS_METRIC = "kiln_process_cpu_seconds"
LOOP_METRIC = "kiln_event_loop_cpu_seconds"
CONNECTIONS_METRIC = "kiln_http_worker_connections"


@dataclass(frozen=True)
class WatchedProcess:
    label: str  # the ``process`` label: "server", "http_worker_0", ...
    pid: int
    loop_thread: int  # the native id of the thread that runs its event loop
    connections: int | None = None  # an HTTP worker's open connections, as it last published them


Processes = Callable[[], Iterable[WatchedProcess]]


class ProcessCpuCollector(Collector):
    """The CPU seconds of each process ``processes()`` names at scrape time, and of its event-loop thread."""

    def __init__(self, processes: Processes) -> None:
        self._processes = processes

    def collect(self) -> Iterator[Metric]:
        # Metric rather than CounterMetricFamily: the samples keep their names, without "_total" (as kiln's other
        # counters, render_metrics).
        process = Metric(PROCESS_METRIC, "CPU time of the process, all its threads, in seconds", "counter")
        loop = Metric(LOOP_METRIC, "CPU time of the process's event-loop thread, in seconds (near 1 per second: "
                                   "that loop is the limit)", "counter")
        connections = Metric(CONNECTIONS_METRIC, "HTTP connections the worker holds open", "gauge")
        for watched in self._processes():
            if watched.connections is not None:
                connections.add_sample(CONNECTIONS_METRIC, {"process": watched.label}, watched.connections)
            try:
                found = psutil.Process(watched.pid)
                with found.oneshot():
                    times = found.cpu_times()
                    threads = found.threads()
            except psutil.Error:  # a worker between its death and its replacement: no sample this time
                continue
            labels = {"process": watched.label}
            process.add_sample(PROCESS_METRIC, labels, times.user + times.system)
            for thread in threads:
                if thread.id == watched.loop_thread:
                    loop.add_sample(LOOP_METRIC, labels, thread.user_time + thread.system_time)
        yield process
        yield loop
        if connections.samples:
            yield connections
