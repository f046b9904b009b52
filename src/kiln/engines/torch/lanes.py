"""Lanes: what lets several threads drive one engine's CUDA graphs at once.

A lane is one CUDA stream with its own graphs (one per batch size, in the lane's own memory pool) and its own
pinned staging buffers. A caller holds a lane from copying inputs in until its outputs are on the host, so two
calls never share static buffers, while calls on different lanes overlap on the GPU: one batch's copies run
beside another's kernels. Lanes are made on demand, up to a limit (each costs graph memory), and reused.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class _Waiter(Generic[T]):
    """A caller waiting for a lane: it blocks on its own lock, and whoever gives a lane back hands it over here."""

    def __init__(self) -> None:
        self.ready = threading.Lock()
        self.ready.acquire()
        self.lane: T | None = None


class LanePool(Generic[T]):
    """Up to ``limit`` lanes, made by ``make`` when every existing one is busy; callers beyond the limit wait, and
    are served in the order they came.

    A lane given back goes straight to the longest waiting caller. Were it put back for anyone to take, the thread
    that just gave it back (still holding the GIL) would take it again on its next call before the woken waiter
    got the GIL to look: with 16 threads on 8 lanes, some threads then waited seconds while the others ran.
    """

    def __init__(self, make: Callable[[int], T], limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a lane pool needs a limit of 1 or more, got {limit}")
        self._make = make
        self._limit = limit
        self._mutex = threading.Lock()  # guards the lists below, never held while a lane is made or waited for
        self._free: deque[T] = deque()
        self._waiters: deque[_Waiter[T]] = deque()
        self._made: list[T] = []
        self._making = 0  # lanes being made now, counted against the limit
        self._make_lock = threading.Lock()  # lanes are made one at a time, as before any other caller's

    @property
    def lanes(self) -> tuple[T, ...]:
        """The lanes made so far, in the order they were made."""
        return tuple(self._made)

    @property
    def waiting(self) -> int:
        """Callers waiting for a lane now."""
        return len(self._waiters)

    @contextlib.contextmanager
    def lane(self) -> Iterator[T]:
        """Hold a lane for the duration of the block: a free one, a new one, or the next to come free."""
        lane = self._take(wait=True)
        assert lane is not None
        try:
            yield lane
        finally:
            self.give_back(lane)

    def try_take(self) -> T | None:
        """A free lane or a new one, without waiting; None when all ``limit`` lanes are held (or callers already
        wait for them). Give it back with :meth:`give_back`."""
        return self._take(wait=False)

    def give_back(self, lane: T) -> None:
        with self._mutex:
            if not self._waiters:
                self._free.append(lane)
                return
            waiter = self._waiters.popleft()
        waiter.lane = lane
        waiter.ready.release()

    def _take(self, wait: bool) -> T | None:
        while True:
            with self._mutex:
                if self._free:  # only while nobody waits: a lane given back goes to a waiter first
                    return self._free.popleft()
                if len(self._made) + self._making < self._limit:
                    index = len(self._made) + self._making
                    self._making += 1
                    waiter = None
                elif not wait:
                    return None
                else:
                    waiter = _Waiter[T]()
                    self._waiters.append(waiter)
            if waiter is None:
                return self._make_lane(index)
            try:
                waiter.ready.acquire()  # blocks without the GIL until give_back hands this caller a lane
            except BaseException:  # interrupted (Ctrl-C in the main thread): leave no lane with a caller who left
                self._abandon(waiter)
                raise
            if waiter.lane is not None:
                return waiter.lane
            # Woken without a lane: one could not be made, so there is room to make one again.

    def _abandon(self, waiter: _Waiter[T]) -> None:
        with self._mutex:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
                return
        # Already woken: pass on what it was given, a lane or the room to make one.
        if waiter.lane is not None:
            self.give_back(waiter.lane)
            return
        with self._mutex:
            woken = self._waiters.popleft() if self._waiters else None
        if woken is not None:
            woken.ready.release()

    def _make_lane(self, index: int) -> T:
        try:
            with self._make_lock:
                lane = self._make(index)
        except BaseException:
            with self._mutex:
                self._making -= 1
                woken = self._waiters.popleft() if self._waiters else None
            if woken is not None:  # it waited for a lane that will not come: let it try to make one
                woken.ready.release()
            raise
        with self._mutex:
            self._made.append(lane)
            self._making -= 1
        return lane
