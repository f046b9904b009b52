"""Lanes: what lets several threads drive one engine's CUDA graphs at once.

A lane is one CUDA stream with its own graphs (one per batch size, in the lane's own memory pool) and its own
pinned staging buffers. A caller holds a lane from copying inputs in until its outputs are on the host, so two
calls never share static buffers, while calls on different lanes overlap on the GPU: one batch's copies run
beside another's kernels. Lanes are made on demand, up to a limit (each costs graph memory), and reused.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class LanePool(Generic[T]):
    """Up to ``limit`` lanes, made by ``make`` when every existing one is busy; callers beyond the limit wait."""

    def __init__(self, make: Callable[[int], T], limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a lane pool needs a limit of 1 or more, got {limit}")
        self._make = make
        self._limit = limit
        self._free: queue.SimpleQueue[T] = queue.SimpleQueue()
        self._made: list[T] = []
        self._making = threading.Lock()

    @property
    def lanes(self) -> tuple[T, ...]:
        """The lanes made so far, in the order they were made."""
        return tuple(self._made)

    @contextlib.contextmanager
    def lane(self) -> Iterator[T]:
        """Hold a lane for the duration of the block: a free one, a new one, or the next to come free."""
        lane = self._take()
        try:
            yield lane
        finally:
            self.give_back(lane)

    def try_take(self) -> T | None:
        """A free lane or a new one, without waiting; None when all ``limit`` lanes are held. Give it back with
        :meth:`give_back`."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._making:
            if len(self._made) < self._limit:
                lane = self._make(len(self._made))
                self._made.append(lane)
                return lane
        return None

    def give_back(self, lane: T) -> None:
        self._free.put(lane)

    def _take(self) -> T:
        lane = self.try_take()
        if lane is not None:
            return lane
        return self._free.get()  # blocks without the GIL until another caller puts its lane back
