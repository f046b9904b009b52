"""Memory sampling: idle and peak per level, RSS of a real process, and NVML's per-process attribution; CPU per level
of a real process, its threads and its children."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import psutil

from kiln.bench.resources import (
    MIB,
    CpuMeter,
    MemorySampler,
    ProcessTree,
    gpu_reader,
    nvml_process_reader,
    rss_reader,
)


def test_idle_is_read_before_the_level_and_peak_is_the_highest_sample() -> None:
    rss = itertools.chain([100 * MIB, 180 * MIB, 150 * MIB], itertools.repeat(120 * MIB))
    gpu = iter([10 * MIB] + [None] * 100)  # a reader that fails later keeps the peak it saw
    sampler = MemorySampler(lambda: next(rss), lambda: next(gpu), interval_s=3600)  # samples only when asked
    sampler.start_level()
    sampler.sample()
    sampler.sample()
    figures = sampler.stop_level()
    assert (figures.rss_idle, figures.rss_peak) == (100.0, 180.0)
    assert (figures.gpu_idle, figures.gpu_peak) == (10.0, 10.0)


def test_nothing_to_read_gives_no_figures() -> None:
    sampler = MemorySampler(None, None)
    sampler.start_level()
    figures = sampler.stop_level()
    assert figures.rss_idle is None and figures.rss_peak is None and figures.gpu_peak is None


def test_rss_of_this_process_is_read_through_psutil() -> None:
    reader = rss_reader(os.getpid())
    assert reader is not None
    value = reader()
    assert value is not None and 10 * MIB < value < 64 * 1024 * MIB
    assert rss_reader(None) is None


def test_rss_of_a_process_that_does_not_exist_is_not_measured() -> None:
    assert rss_reader(2**22 + 12345) is None


@dataclass
class ProcessInfo:
    pid: int
    usedGpuMemory: int | None  # NVML's field name


class FakeNvml:
    """NVML's process listing for two GPUs; NVML cannot run on a machine without an NVIDIA driver."""

    class NVMLError(Exception):
        pass

    def __init__(self, processes: list[list[ProcessInfo]]) -> None:
        self.processes = processes

    def nvmlDeviceGetCount(self) -> int:  # NVML's names
        return len(self.processes)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[ProcessInfo]:
        return self.processes[handle]


def test_nvml_memory_of_the_process_is_summed_over_gpus() -> None:
    me = os.getpid()
    nvml = FakeNvml([[ProcessInfo(me, 300 * MIB), ProcessInfo(1, 999 * MIB)], [ProcessInfo(me, 100 * MIB)]])
    assert nvml_process_reader(nvml, me)() == 400 * MIB
    reader, source = gpu_reader(me, in_process=False, nvml=nvml)
    assert reader is not None and source == "nvml (process)"


def test_a_process_nvml_does_not_list_has_no_gpu_figure() -> None:
    nvml = FakeNvml([[ProcessInfo(1, 999 * MIB), ProcessInfo(os.getpid(), None)]])
    assert nvml_process_reader(nvml, os.getpid())() is None
    assert gpu_reader(os.getpid(), in_process=False, nvml=nvml) == (None, None)


def test_without_nvml_or_a_cuda_context_gpu_memory_is_absent() -> None:
    # this machine has no NVIDIA driver; torch, when imported, has no CUDA context here
    assert gpu_reader(os.getpid(), in_process=True) == (None, None)


def _burn(stop: threading.Event) -> None:
    while not stop.is_set():
        pass


def _share_of_a_core(thread: threading.Thread, since: float) -> float:
    """The CPU ``thread`` has had since ``since`` (time.monotonic()), per wall second, read from its own clock: what
    a meter should find for it however busy the rest of the machine keeps the cores."""
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident)) / (time.monotonic() - since)


def test_cpu_of_this_process_names_the_thread_that_burned_it() -> None:
    meter = CpuMeter(os.getpid())
    stop = threading.Event()
    burner = threading.Thread(target=_burn, args=(stop,))
    started = time.monotonic()
    burner.start()
    try:
        meter.start()
        time.sleep(0.6)
        burned = _share_of_a_core(burner, started)
        figures = meter.stop()
    finally:
        stop.set()
        burner.join()
    assert figures is not None
    assert burned > 0.05, "the spinning thread got almost no CPU: nothing to measure"
    assert figures.busiest_thread > 0.7 * burned, (figures, burned)  # one thread spun for the whole level
    assert figures.process >= figures.busiest_thread - 0.01
    assert figures.main_thread is not None and figures.main_thread < 0.2, figures  # this thread slept meanwhile
    assert 0.0 <= figures.busiest_child <= figures.children  # whatever children the test run has
    assert 0.0 <= figures.machine_idle_pct <= 100.0


def test_cpu_of_children_is_counted_apart_from_the_process() -> None:
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None and parent.stdout.readline() == b"started\n"
        meter = CpuMeter(parent.pid)
        meter.start()
        time.sleep(0.6)
        figures = meter.stop()
    finally:
        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
    assert figures is not None
    assert figures.children > 0.3, figures  # the spinning child
    assert figures.busiest_child == figures.children  # the only child
    assert figures.process < 0.2, figures  # the parent slept


def test_cpu_without_a_process_is_not_measured() -> None:
    for meter in (CpuMeter(None), CpuMeter(2**22 + 12345)):
        meter.start()
        assert meter.stop() is None


def test_cpu_is_read_up_to_the_last_mark_so_threads_that_end_with_the_load_still_count() -> None:
    meter = CpuMeter(os.getpid())
    stop = threading.Event()
    burner = threading.Thread(target=_burn, args=(stop,))
    meter.start()
    started = time.monotonic()
    burner.start()
    time.sleep(0.6)
    burned = _share_of_a_core(burner, started)
    meter.mark()  # the end of the last window: the load is still running
    stop.set()
    burner.join()
    time.sleep(0.3)  # teardown, not measured
    figures = meter.stop()
    assert figures is not None
    assert burned > 0.05, "the spinning thread got almost no CPU: nothing to measure"
    assert figures.busiest_thread > 0.7 * burned, (figures, burned)  # read at the mark, while it still ran


def test_the_process_tree_is_listed_again_only_when_due_or_asked() -> None:
    me = psutil.Process()
    tree, every_time = ProcessTree(me, refresh_s=60), ProcessTree(me, refresh_s=0)
    before = {p.pid for p in tree.descendants()}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert {p.pid for p in tree.descendants()} == before  # not due: the last listing
        assert child.pid in {p.pid for p in every_time.descendants()}
        assert child.pid in {p.pid for p in tree.descendants(fresh=True)}
    finally:
        child.kill()
        child.wait()
