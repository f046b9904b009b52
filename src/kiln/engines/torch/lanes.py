"""Lanes: what lets several threads drive one engine's CUDA graphs at once.

A lane is one CUDA stream with its own graphs (one per batch size, in the lane's own memory pool) and its own
pinned staging buffers. A caller holds a lane from copying inputs in until its outputs are on the host, so two
calls never share static buffers, while calls on different lanes overlap on the GPU: one batch's copies run
beside another's kernels. Lanes are made on demand, up to a limit (each costs graph memory), and reused.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class _Waiter(Generic[T]):
    """A caller waiting for a lane: it blocks on its own lock, and is handed, under the pool's mutex, either a lane
    given back or the room to make one (a slot another caller failed to fill)."""

    def __init__(self) -> None:
        self.ready = threading.Lock()
        self.ready.acquire()
        self.lane: T | None = None
        self.may_make = False


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
        self._mutex = threading.Lock()  # guards the fields below; never held while a lane is made or waited for
        self._free: deque[T] = deque()
        self._waiters: deque[_Waiter[T]] = deque()
        self._made: list[T] = []
        self._making = 0  # slots being filled now (lanes being made), counted against the limit
        self._make_lock = threading.Lock()  # lanes are made one at a time
        self._indices = itertools.count()

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
        lane = self._take()
        try:
            yield lane
        finally:
            self.give_back(lane)

    def try_take(self) -> T | None:
        """A free lane, or a new one when no other lane is being made; None when every lane is held, callers
        already wait, or another thread is making one (the event loop calls this and must not wait for that).
        Give it back with :meth:`give_back`."""
        with self._mutex:
            if self._free:  # only while nobody waits: a lane given back goes to a waiter first
                return self._free.popleft()
            if self._making or len(self._made) >= self._limit:
                return None
            self._making += 1
        return self._make_lane()

    def give_back(self, lane: T) -> None:
        with self._mutex:
            if not self._waiters:
                self._free.append(lane)
                return
            waiter = self._waiters.popleft()
            waiter.lane = lane
        waiter.ready.release()

    def _take(self) -> T:
        with self._mutex:
            if self._free:
                return self._free.popleft()
            if len(self._made) + self._making < self._limit:
                self._making += 1
                waiter = None
            else:
                waiter = _Waiter[T]()
                self._waiters.append(waiter)
        if waiter is None:
            return self._make_lane()
        try:
            waiter.ready.acquire()  # blocks without the GIL until this caller is handed a lane or a slot
            if waiter.lane is not None:
                return waiter.lane
            assert waiter.may_make
        except BaseException:  # interrupted (Ctrl-C in the main thread): pass on what this caller was handed
            self._abandon(waiter)
            raise
        return self._make_lane()  # the slot was counted for this caller when it was handed over

    def _abandon(self, waiter: _Waiter[T]) -> None:
        with self._mutex:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
                return
            lane, may_make = waiter.lane, waiter.may_make
        if lane is not None:
            self.give_back(lane)
        elif may_make:
            self._release_slot()

    def _make_lane(self) -> T:
        """Fill a slot already counted in ``_making``: make a lane, or hand the slot on if making fails."""
        try:
            with self._make_lock:
                lane = self._make(next(self._indices))
        except BaseException:
            self._release_slot()
            raise
        with self._mutex:
            self._made.append(lane)
            self._making -= 1
        return lane

    def _release_slot(self) -> None:
        """A counted slot stays empty: the longest waiting caller gets it (it waited for a lane that will not come
        back), or it is freed."""
        with self._mutex:
            if not self._waiters:
                self._making -= 1
                return
            waiter = self._waiters.popleft()
            waiter.may_make = True
        waiter.ready.release()
