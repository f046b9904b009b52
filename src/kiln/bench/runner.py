"""``kiln.bench.run``: open the target, check one request, measure every load level in turn, collect the results."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

from kiln.bench.data import build_requests
from kiln.bench.machine import machine_info
from kiln.bench.measure import Settings, measure_level
from kiln.bench.options import BenchOptions
from kiln.bench.perf_analyzer import PerfAnalyzerLoad, find_binary
from kiln.bench.progress import Progress
from kiln.bench.records import Level
from kiln.bench.resources import CpuFigures, CpuMeter, MemoryFigures, MemorySampler, gpu_reader, rss_reader
from kiln.bench.result import BenchResult, LevelResult
from kiln.bench.shared_inputs import shared_inputs
from kiln.bench.targets import create_target


def run(options: BenchOptions, progress: Progress | None = None,
        on_level: Callable[[LevelResult], None] | None = None) -> BenchResult:
    """Measure ``options.model`` on ``options.target`` at every load level. ``on_level`` sees each level's result
    as soon as it is measured; ``progress`` (default: silent) shows each window."""
    progress = progress if progress is not None else Progress(enabled=False)
    settings = Settings(interval_ns=options.measurement_interval_ms * 1_000_000,
                        stability_percentage=options.stability_percentage, max_trials=options.max_trials)
    binary = find_binary(options.perf_analyzer) if options.load_generator == "perf_analyzer" else None
    with create_target(options) as target, contextlib.ExitStack() as inputs:
        progress.note(f"opening target {options.target} for model '{options.model}'")
        model = target.open()
        requests = build_requests(model, options.input_data, options.batch_size, options.shapes, options.seed)
        if options.input_memory == "shared":
            requests = inputs.enter_context(shared_inputs(requests))
        target.prepare(requests)
        pid = target.process_id()
        gpu, gpu_source = gpu_reader(pid, target.in_process)
        sampler = _LevelMeter(MemorySampler(rss_reader(pid), gpu), CpuMeter(pid))
        external = PerfAnalyzerLoad(binary, options, target.url or "") if binary is not None else None
        results: list[LevelResult] = []
        for value in options.levels():
            level = _level(options, value)
            if external is not None:
                result = external.measure(level, sampler, progress)
            else:
                measured = measure_level(target, level, settings, sampler,
                                         on_window=functools.partial(progress.window, level))
                progress.end_level()
                result = LevelResult.from_measurement(measured, options.batch_size)
            result = dataclasses.replace(result, cpu=sampler.cpu)
            results.append(result)
            if on_level is not None:
                on_level(result)
            threshold = options.latency_threshold_ms
            if threshold is not None and result.latency_ms.avg > threshold:
                progress.note(f"average latency {result.latency_ms.avg:.3f} ms exceeds --latency-threshold "
                              f"{threshold:g} ms: the sweep stops here")
                break
        return BenchResult(model=options.model, target=options.target, url=target.url,
                           batch_size=options.batch_size, machine=machine_info(gpu_source), results=results,
                           options=options.describe())


class _LevelMeter:
    """The level's memory (sampled while it runs) and its CPU (from its start to its last measured window)."""

    def __init__(self, memory: MemorySampler, cpu: CpuMeter) -> None:
        self._memory = memory
        self._cpu = cpu
        self.cpu: CpuFigures | None = None  # the last level's

    def start_level(self) -> None:
        self._memory.start_level()
        self._cpu.start()

    def sample(self) -> None:  # at the end of each measured window
        self._memory.sample()
        self._cpu.mark()

    def stop_level(self) -> MemoryFigures:
        self.cpu = self._cpu.stop()
        return self._memory.stop_level()


def _level(options: BenchOptions, value: float) -> Level:
    if options.request_rate_mode:
        return Level(request_rate=value, distribution=options.request_distribution,
                     max_outstanding=options.max_outstanding, seed=options.seed)
    return Level(concurrency=int(value), seed=options.seed)
