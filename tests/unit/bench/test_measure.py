"""Windows, perf_analyzer's stability rule and the merge, on synthetic requests under a made-up clock."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kiln.bench.measure import Measurement, Settings, Window, cut_window, is_stable, measure_level, merge
from kiln.bench.records import ClientTimes, Level, Recorder, RequestRecord
from kiln.bench.resources import MemoryFigures, MemorySampler
from kiln.bench.schedule import SendCounts
from kiln.bench.server_stats import Duration, ServerCounters

MS = 1_000_000
NO_MEMORY = MemoryFigures()


def window(count: int, latency_ns: int, duration_ns: int = 1000 * MS, errors: int = 0) -> Window:
    return Window(start_ns=0, end_ns=duration_ns, latencies_ns=(latency_ns,) * count, errors=errors, send_ns=0,
                  recv_ns=0, client_count=0, server_before=None, server_after=None)


def test_a_window_counts_requests_that_ended_inside_it() -> None:
    records = [
        RequestRecord(start_ns=10, end_ns=100, ok=True, client=None),  # ended at the window's start: the last one's
        RequestRecord(start_ns=90, end_ns=120, ok=True, client=None),  # started before the window: counted
        RequestRecord(start_ns=100, end_ns=150, ok=True, client=ClientTimes(5, 7)),
        RequestRecord(start_ns=160, end_ns=200, ok=True, client=ClientTimes(3, 1)),
        RequestRecord(start_ns=170, end_ns=190, ok=False, client=None),  # a failure: an error, no latency
        RequestRecord(start_ns=180, end_ns=250, ok=True, client=None),  # ends after the window
    ]
    cut = cut_window(records, 100, 200, None, None)
    assert cut.latencies_ns == (30, 50, 40)
    assert cut.errors == 1
    assert (cut.send_ns, cut.recv_ns, cut.client_count) == (8, 8, 2)
    assert cut.throughput_per_s == pytest.approx(3 / 100e-9)
    assert cut.avg_latency_ns == 40


def test_recorder_keeps_requests_that_end_after_the_window_for_the_next_one() -> None:
    recorder = Recorder()
    for end in (10, 20, 30):
        recorder.add(RequestRecord(0, end, True, None))
    assert [r.end_ns for r in recorder.take_until(20)] == [10, 20]
    assert [r.end_ns for r in recorder.take_until(40)] == [30]
    assert recorder.take_until(40) == []


def test_three_windows_within_the_percentage_are_stable() -> None:
    windows = [window(1000, 10 * MS), window(1050, 10 * MS), window(1095, 10_900_000)]
    assert is_stable(windows, 10.0)  # 1095 / 1000 and 10.9 / 10 are both <= 1.10


def test_throughput_beyond_the_percentage_is_unstable() -> None:
    assert not is_stable([window(1000, 10 * MS), window(1000, 10 * MS), window(1101, 10 * MS)], 10.0)
    assert is_stable([window(1000, 10 * MS), window(1000, 10 * MS), window(1101, 10 * MS)], 11.0)


def test_latency_beyond_the_percentage_is_unstable() -> None:
    assert not is_stable([window(1000, 10 * MS), window(1000, 12 * MS), window(1000, 10 * MS)], 10.0)


def test_only_the_last_three_windows_are_judged() -> None:
    assert is_stable([window(10, 99 * MS), window(1000, 10 * MS), window(1000, 10 * MS), window(1000, 10 * MS)], 10)


def test_fewer_than_three_windows_or_an_empty_one_are_unstable() -> None:
    assert not is_stable([window(1000, MS), window(1000, MS)], 10.0)
    assert not is_stable([window(0, MS), window(0, MS), window(0, MS)], 10.0)


def test_merge_pools_the_last_three_windows_and_counts_every_error() -> None:
    windows = [window(5, 90 * MS, errors=2), window(10, 10 * MS), window(20, 20 * MS, errors=1),
               window(30, 30 * MS)]
    level = Level(concurrency=4)
    merged = merge(level, windows, stable=True, sends=None, memory=NO_MEMORY)
    assert merged.windows == 4
    assert merged.requests == 60
    assert merged.duration_ns == 3000 * MS
    assert merged.throughput_per_s == pytest.approx(20.0)
    assert merged.errors == 3
    assert merged.latency is not None
    assert merged.latency.avg_ns == pytest.approx((10 * 10 + 20 * 20 + 30 * 30) / 60 * MS)
    assert merged.latency.p50_ns == 30 * MS  # index round(0.5 * 59) = 30: the first of the 30 ms requests
    assert merged.client_send_ns is None and merged.server is None


def test_merge_takes_the_server_counters_across_the_merged_windows() -> None:
    def counters(success: int, queue_ns: int) -> ServerCounters:
        return ServerCounters(success, {"queue": Duration(success, queue_ns),
                                        "compute_infer": Duration(success, success * 100_000)})

    boundaries = [counters(0, 0), counters(100, 900_000), counters(300, 1_100_000), counters(400, 1_200_000)]
    windows = [Window(0, MS, (MS,), 0, 4, 6, 1, boundaries[i], boundaries[i + 1]) for i in range(3)]
    merged = merge(Level(concurrency=1), windows[1:], stable=False, sends=None, memory=NO_MEMORY)
    assert merged.server is not None
    assert merged.server.success == 300
    assert merged.server.per_request_us() == pytest.approx(
        {"queue": 1.0, "compute_input": 0.0, "compute_infer": 100.0, "compute_output": 0.0})
    assert merged.client_send_ns == 4 and merged.client_recv_ns == 6


class ScriptedLoad:
    """A load whose requests are written by the test's sleep: window i gets ``throughputs[i]`` requests per
    second of ``latency_ns`` each, finishing evenly over the window."""

    def __init__(self, throughputs: Sequence[int], latency_ns: int) -> None:
        self.throughputs = list(throughputs)
        self.latency_ns = latency_ns
        self.now = 1_000 * MS
        self.recorder: Recorder | None = None
        self.window = 0
        self.started: Level | None = None
        self.stopped = False
        self.served = 0

    def start(self, level: Level, recorder: Recorder) -> None:
        self.started, self.recorder = level, recorder

    def stop(self) -> SendCounts | None:
        self.stopped = True
        return SendCounts(scheduled=9, delayed=1, dropped=0)

    def server_stats(self) -> ServerCounters | None:
        return ServerCounters(self.served, {"queue": Duration(self.served, self.served * 2_000)})

    def clock(self) -> int:
        return self.now

    def sleep_until(self, deadline_ns: int) -> None:
        assert self.recorder is not None
        count = self.throughputs[min(self.window, len(self.throughputs) - 1)] * (deadline_ns - self.now) // 10**9
        step = (deadline_ns - self.now) // max(count, 1)
        for i in range(count):
            end = self.now + (i + 1) * step
            self.recorder.add(RequestRecord(end - self.latency_ns, end, True, None))
        self.recorder.add(RequestRecord(deadline_ns - 5, deadline_ns + 10, True, None))  # straddles the boundary
        self.served += count
        self.window += 1
        self.now = deadline_ns


def measure(load: ScriptedLoad, stability: float = 10.0, trials: int = 10) -> tuple[Measurement, list[int]]:
    seen: list[int] = []
    measured = measure_level(load, Level(concurrency=2), Settings(500 * MS, stability, trials),
                             MemorySampler(None, None), on_window=lambda ws: seen.append(len(ws)),
                             clock=load.clock, sleep_until=load.sleep_until)
    return measured, seen


def test_a_steady_level_stops_after_three_windows() -> None:
    load = ScriptedLoad([1000], latency_ns=MS // 10)
    measured, seen = measure(load)
    assert seen == [1, 2, 3]
    assert load.started == Level(concurrency=2) and load.stopped
    assert measured.stable and measured.windows == 3
    assert measured.requests == 1500 + 2  # plus the requests straddling the two inner boundaries
    assert measured.throughput_per_s == pytest.approx(1502 / 1.5)
    assert measured.server is not None
    assert measured.server.per_request_us()["queue"] == pytest.approx(2.0)
    assert measured.sends == SendCounts(9, 1, 0)


def test_a_warming_level_is_stable_once_the_last_three_windows_agree() -> None:
    load = ScriptedLoad([200, 600, 1000, 1000, 1000], latency_ns=MS)
    measured, seen = measure(load)
    assert seen == [1, 2, 3, 4, 5]
    assert measured.stable and measured.requests == 1500 + 3


def test_an_unsteady_level_stops_at_max_trials_and_says_so() -> None:
    load = ScriptedLoad([200, 1000] * 10, latency_ns=MS)
    measured, seen = measure(load, trials=4)
    assert seen == [1, 2, 3, 4]
    assert not measured.stable and measured.windows == 4
    assert measured.requests == 500 + 100 + 500 + 3  # windows 2 to 4, each with the request straddling its start


def test_windows_lengthen_when_they_count_too_few_requests() -> None:
    load = ScriptedLoad([2], latency_ns=MS)  # 2 requests/s: a 500 ms window holds one
    lengths: list[int] = []
    measure_level(load, Level(concurrency=2), Settings(500 * MS, 10.0, 4), MemorySampler(None, None),
                  on_window=lambda ws: lengths.append(ws[-1].duration_ns // MS),
                  clock=load.clock, sleep_until=load.sleep_until)
    # The first window holds one request: the next is twice as long and holds three (one straddled its start).
    assert lengths == [500, 1000, 1000, 1000]


def test_a_load_that_fails_to_start_still_stops_the_memory_sampler_and_itself() -> None:
    class FailingLoad(ScriptedLoad):
        def start(self, level: Level, recorder: Recorder) -> None:
            raise RuntimeError("engine did not load")

    class Meter:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def start_level(self) -> None:
            self.calls.append("start")

        def sample(self) -> None:
            self.calls.append("sample")

        def stop_level(self) -> MemoryFigures:
            self.calls.append("stop")
            return NO_MEMORY

    load, meter = FailingLoad([1000], latency_ns=MS), Meter()
    with pytest.raises(RuntimeError, match="engine did not load"):
        measure_level(load, Level(concurrency=1), Settings(500 * MS), meter, clock=load.clock,
                      sleep_until=load.sleep_until)
    assert meter.calls == ["start", "stop"] and load.stopped
