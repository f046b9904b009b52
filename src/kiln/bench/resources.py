"""Memory of the process under test: RSS through psutil, GPU memory through NVML or torch.cuda; idle before a
level's load starts, peak while it runs (sampled every 100 ms by a background thread). Its CPU over each level
(psutil): the process, its busiest thread (a server's event loop, when one thread is what stops it), its children
(a server's frontend worker processes) and the machine's idle share, so that a level that falls short names the
resource that stopped it.

The process under test is the server for http and grpc (``--server-pid``, the ``kiln serve`` kiln bench started,
or the local process listening on the URL's port) and this very process for direct and inprocess. RSS sums the
process and its children. GPU memory is NVML's per-process figure (``nvidia-ml-py``) when the process shows up in
NVML's list; otherwise, for direct and inprocess, the used memory of the GPUs torch sees, once torch has a CUDA
context in this process (it is never created just to measure). Figures that cannot be read are None.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

log = logging.getLogger("kiln.bench")

MIB = 1024 * 1024
SAMPLE_INTERVAL_S = 0.1
TREE_REFRESH_S = 1.0

ByteReader = Callable[[], "int | None"]


@dataclass(frozen=True)
class MemoryFigures:
    """Memory in MiB (2**20 bytes): before the level's load started and the highest sample during it."""

    rss_idle: float | None = None
    rss_peak: float | None = None
    gpu_idle: float | None = None
    gpu_peak: float | None = None


@dataclass(frozen=True)
class CpuFigures:
    """Cores used on average over a level (CPU seconds per second): the process under test alone, its busiest
    thread, its children together and the busiest of them; and the share of the whole machine's CPU time that was
    idle (percent). ``main_thread`` is the process's first thread, which runs kiln's event loop; the busiest thread
    may be another one (the thread that waits for the device, a staging helper). None in files written before it
    was measured."""

    process: float
    busiest_thread: float
    children: float
    machine_idle_pct: float
    busiest_child: float = 0.0
    main_thread: float | None = None


class _CpuReading(NamedTuple):
    at: float  # time.monotonic()
    process: float  # CPU seconds of the process alone
    threads: dict[int, float]  # per thread id
    children: dict[int, float]  # per child pid
    machine: Any  # psutil.cpu_times()


class ProcessTree:
    """A process's descendants, listed again at most every ``refresh_s``. Listing them reads every process's
    /proc entry (psutil), and in a process whose other threads keep the GIL busy (a direct bench's callers) each
    of those reads waits for it: listed at every 100 ms memory sample, that took 0.2 s a time on 2 cores and stole
    the GIL from the load. A child started since the last listing is counted from the next one."""

    def __init__(self, process: Any, refresh_s: float = TREE_REFRESH_S) -> None:
        self._process = process
        self._refresh_s = refresh_s
        self._members: list[Any] = []
        self._listed_at = -float("inf")
        self._lock = threading.Lock()

    def descendants(self, fresh: bool = False) -> list[Any]:
        """The descendants (psutil processes) as last listed; listed now when ``fresh`` or when due. Raises
        psutil's error when the process itself is gone."""
        with self._lock:
            now = time.monotonic()
            if fresh or now - self._listed_at >= self._refresh_s:
                self._members = self._process.children(recursive=True)
                self._listed_at = now
            return self._members


class CpuMeter:
    """The CPU of ``pid`` (and its children) between :meth:`start` and the last :meth:`mark` (else :meth:`stop`);
    None figures without psutil or once the process is gone. Marking at the end of each measured window keeps the
    load's own teardown out, and the threads of a load that stops (the bench process's) in."""

    def __init__(self, pid: int | None) -> None:
        self._process: Any = None
        self._start: _CpuReading | None = None
        self._mark: _CpuReading | None = None
        if pid is None:
            return
        with contextlib.suppress(Exception):  # psutil missing (memory says so already) or no such process
            import psutil

            self._process = psutil.Process(pid)
            self._tree = ProcessTree(self._process)

    def start(self) -> None:
        self._start, self._mark = self._read(fresh=True), None

    def mark(self) -> None:
        self._mark = self._read() or self._mark

    def stop(self) -> CpuFigures | None:
        before, after = self._start, self._mark or self._read()
        self._start = self._mark = None
        if before is None or after is None or after.at <= before.at:
            return None
        wall = after.at - before.at
        busiest = max((spent - before.threads.get(tid, 0.0) for tid, spent in after.threads.items()), default=0.0)
        # A child that started during the level counts from zero; one that ended is lost (the figure says less).
        children = [spent - before.children.get(pid, 0.0) for pid, spent in after.children.items()]
        process = (after.process - before.process) / wall
        main = (after.threads.get(self._process.pid, 0.0) - before.threads.get(self._process.pid, 0.0)) / wall
        # Thread and process times are read in clock ticks a moment apart: a thread may seem ahead of its process.
        return CpuFigures(process=round(process, 3), busiest_thread=round(min(busiest / wall, process), 3),
                          children=round(sum(children) / wall, 3),
                          machine_idle_pct=round(_idle_share(before.machine, after.machine), 1),
                          busiest_child=round(max(children, default=0.0) / wall, 3),
                          main_thread=round(min(main, process), 3))

    def _read(self, fresh: bool = False) -> _CpuReading | None:
        if self._process is None:
            return None
        import psutil

        try:
            # The moment the process's times were read: the middle of their reads. In a process whose other
            # threads keep the GIL busy, each file read here can wait a switch interval for it, and the scan of
            # /proc for children below far longer: timed after it, a window stretched by up to a second and every
            # figure came out too low.
            reading = time.monotonic()
            with self._process.oneshot():
                times = self._process.cpu_times()
                threads = {t.id: t.user_time + t.system_time for t in self._process.threads()}
            at = (reading + time.monotonic()) / 2
            children = {}
            for child in self._tree.descendants(fresh):
                with contextlib.suppress(psutil.Error):  # a child that ended meanwhile
                    child_times = child.cpu_times()
                    children[child.pid] = child_times.user + child_times.system
            return _CpuReading(at, times.user + times.system, threads, children, psutil.cpu_times())
        except psutil.Error:
            return None


def _idle_share(before: Any, after: Any) -> float:
    total = sum(after) - sum(before)
    return 100.0 * (after.idle - before.idle) / total if total > 0 else 0.0


class _Process(Protocol):
    pid: int

    def memory_info(self) -> Any: ...

    def children(self, recursive: bool = False) -> list[Any]: ...


def rss_reader(pid: int | None) -> ByteReader | None:
    """Resident memory of ``pid`` and its children, or None without psutil or without that process."""
    if pid is None:
        return None
    try:
        import psutil
    except ImportError:
        log.warning("psutil is not installed: RSS is not measured (pip install psutil)")
        return None
    try:
        process: _Process = psutil.Process(pid)
    except psutil.Error:
        log.warning("process %d does not exist: its RSS is not measured", pid)
        return None

    tree = ProcessTree(process)

    def read() -> int | None:
        try:
            members = [process, *tree.descendants()]
        except psutil.Error:
            return None
        total = 0
        for member in members:
            with contextlib.suppress(psutil.Error):
                total += int(member.memory_info().rss)
        return total

    return read


def process_tree(pid: int) -> set[int]:
    """``pid`` and its descendants (just ``pid`` without psutil)."""
    try:
        import psutil

        return {pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))}
    except Exception:  # psutil missing or the process gone: the pid alone still identifies it in NVML
        return {pid}


def _tree(pid: int) -> ProcessTree | None:
    try:
        import psutil

        return ProcessTree(psutil.Process(pid))
    except Exception:  # psutil missing or no such process
        return None


def import_nvml() -> Any | None:
    """pynvml (package nvidia-ml-py) when installed, initialized, with at least one GPU; else None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the deprecated `pynvml` shim package warns on import
            nvml = importlib.import_module("pynvml")
        nvml.nvmlInit()
        return nvml if nvml.nvmlDeviceGetCount() > 0 else None
    except Exception:  # no library, no driver, no GPU: GPU memory is simply not measured
        return None


def nvml_process_reader(nvml: Any, pid: int) -> ByteReader:
    """GPU memory NVML attributes to ``pid`` and its children, over every GPU; None when NVML lists none of them
    (a process without a CUDA context, or a container whose PIDs NVML cannot see)."""
    tree = _tree(pid)

    def read() -> int | None:
        pids = {pid}
        if tree is not None:
            with contextlib.suppress(Exception):  # the process gone: the pid alone still identifies it in NVML
                pids.update(child.pid for child in tree.descendants())
        total, seen = 0, False
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if proc.pid in pids and proc.usedGpuMemory is not None:
                        total += int(proc.usedGpuMemory)
                        seen = True
        except nvml.NVMLError:
            return None
        return total if seen else None

    return read


def torch_device_reader() -> ByteReader | None:
    """Used memory (total - free) of the GPUs torch sees, when torch already runs CUDA in this process."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None

    def read() -> int | None:
        used = 0
        for device in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(device)
            used += int(total - free)
        return used

    return read


def gpu_reader(pid: int | None, in_process: bool, nvml: Any | None = None) -> tuple[ByteReader | None, str | None]:
    """The best GPU memory reader for the process under test and a word on what it measures."""
    nvml = nvml if nvml is not None else import_nvml()
    if nvml is not None and pid is not None:
        reader = nvml_process_reader(nvml, pid)
        if reader() is not None:
            return reader, "nvml (process)"
    torch_reader = torch_device_reader() if in_process else None
    if torch_reader is not None:
        return torch_reader, "torch.cuda (device used)"
    return None, None


class MemorySampler:
    """Idle and peak memory per level; samples in a background thread while a level runs."""

    def __init__(self, rss: ByteReader | None, gpu: ByteReader | None,
                 interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self._rss = rss
        self._gpu = gpu
        self._interval_s = interval_s
        self._idle: tuple[int | None, int | None] = (None, None)
        self._peak: list[int | None] = [None, None]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start_level(self) -> None:
        rss, gpu = self._read()
        self._idle = (rss, gpu)
        self._peak = [rss, gpu]
        if self._rss is None and self._gpu is None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kiln-bench-memory", daemon=True)
        self._thread.start()

    def sample(self) -> None:
        readings = self._read()
        with self._lock:
            self._peak = [_max(old, new) for old, new in zip(self._peak, readings, strict=True)]

    def stop_level(self) -> MemoryFigures:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self.sample()
        with self._lock:
            peak = list(self._peak)
        return MemoryFigures(rss_idle=_mib(self._idle[0]), rss_peak=_mib(peak[0]),
                             gpu_idle=_mib(self._idle[1]), gpu_peak=_mib(peak[1]))

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.sample()

    def _read(self) -> tuple[int | None, int | None]:
        return (self._rss() if self._rss is not None else None, self._gpu() if self._gpu is not None else None)


def _max(old: int | None, new: int | None) -> int | None:
    if old is None:
        return new
    return old if new is None else max(old, new)


def _mib(value: int | None) -> float | None:
    return None if value is None else round(value / MIB, 3)

