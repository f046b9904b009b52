"""kiln_process_cpu_seconds and kiln_event_loop_cpu_seconds, read from the real /proc through psutil."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from kiln.frontends.metrics import render_metrics
from kiln.frontends.metrics_processes import ProcessCpuCollector, WatchedProcess
from kiln.testing.cpu import spin


def _scrape(processes: list[WatchedProcess]) -> dict[tuple[str, str], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ProcessCpuCollector(lambda: processes))
    text = render_metrics(registry).decode()
    assert "# TYPE kiln_process_cpu_seconds counter" in text and "# TYPE kiln_event_loop_cpu_seconds counter" in text
    return {(sample.name, sample.labels["process"]): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_the_loop_thread_counts_its_own_cpu_and_the_process_every_thread() -> None:
    here = [WatchedProcess("server", os.getpid(), threading.get_native_id())]
    before = _scrape(here)
    spin(0.3)  # on the "loop" thread
    helper = threading.Thread(target=spin, args=(0.3,))
    helper.start()
    helper.join()
    after = _scrape(here)
    loop = after[("kiln_event_loop_cpu_seconds_total", "server")] - before[("kiln_event_loop_cpu_seconds_total",
                                                                            "server")]
    process = after[("kiln_process_cpu_seconds_total", "server")] - before[("kiln_process_cpu_seconds_total",
                                                                            "server")]
    # Clock ticks are 10 ms: generous bounds, and the helper's 0.3 s counts for the process only.
    assert 0.2 <= loop <= 0.45
    assert process >= loop + 0.2


def test_a_process_that_is_gone_has_no_samples_and_the_others_still_do() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    found = _scrape([WatchedProcess("http_worker_0", child.pid, child.pid),
                     WatchedProcess("server", os.getpid(), threading.get_native_id())])
    assert ("kiln_process_cpu_seconds_total", "server") in found
    assert ("kiln_event_loop_cpu_seconds_total", "server") in found
    assert not any(label == "http_worker_0" for _, label in found)


def test_http_workers_connections_are_a_gauge_of_their_own() -> None:
    me = os.getpid(), threading.get_native_id()
    found = _scrape([WatchedProcess("server", *me), WatchedProcess("http_worker_0", *me, connections=5),
                     WatchedProcess("http_worker_1", *me, connections=0), WatchedProcess("grpc_worker_0", *me)])
    assert {label: value for (name, label), value in found.items() if name == "kiln_http_worker_connections"} == \
        {"http_worker_0": 5, "http_worker_1": 0}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ProcessCpuCollector(lambda: [WatchedProcess("server", *me)]))
    assert "kiln_http_worker_connections" not in render_metrics(registry).decode()  # no HTTP workers, no family
