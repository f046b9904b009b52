"""The busy measure of an event loop's thread: its CPU time over wall time, window by window."""

from __future__ import annotations

import time

from kiln.batching.loop_load import LoopLoad
from kiln.testing.cpu import spin


class _Clocks:
    def __init__(self) -> None:
        self.wall = 100.0
        self.cpu = 3.0

    def load(self) -> LoopLoad:  # windows of 40 ms: steps of 50 ms close one whatever the float rounding
        return LoopLoad(0.04, 0.75, 0.5, wall=lambda: self.wall, cpu=lambda: self.cpu)

    def run(self, load: LoopLoad, seconds: float, share: float) -> bool:
        self.wall += seconds
        self.cpu += seconds * share
        return load.busy()


def test_a_thread_turns_busy_at_busy_share_and_calm_only_below_calm_share() -> None:
    clocks = _Clocks()
    load = clocks.load()
    assert not clocks.run(load, 0.05, 0.7)  # below busy_share
    assert clocks.run(load, 0.05, 0.8)
    assert clocks.run(load, 0.05, 0.6)  # between the two: stays busy
    assert not clocks.run(load, 0.05, 0.4)
    assert not clocks.run(load, 0.05, 0.7)  # between the two: stays calm


def test_the_verdict_changes_only_once_a_whole_window_has_passed() -> None:
    clocks = _Clocks()
    load = clocks.load()
    assert not clocks.run(load, 0.03, 1.0)  # 30 ms of a full core: not a window (40 ms) yet
    assert clocks.run(load, 0.03, 1.0)  # 60 ms at one core
    assert clocks.run(load, 0.01, 1.0)  # inside the next window nothing changes yet
    assert not clocks.run(load, 0.04, 0.0)  # the 50 ms window it closes ran at a fifth of a core


def test_a_long_idle_gap_makes_a_busy_thread_calm() -> None:
    clocks = _Clocks()
    load = clocks.load()
    assert clocks.run(load, 0.05, 1.0)
    assert not clocks.run(load, 10.0, 0.01)


def test_a_spinning_thread_is_busy_and_a_sleeping_one_is_not() -> None:
    spinning = LoopLoad(0.02, 0.5, 0.3)  # shares with a margin: the machine running the tests is shared
    spin(0.03)
    assert spinning.busy()
    time.sleep(0.05)
    assert not spinning.busy()
