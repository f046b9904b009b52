"""What system and CUDA shared-memory registries share: regions by name, the requests using each, and unregistering
that waits (bounded) for those requests instead of closing memory they still read or write."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from kiln.errors import AlreadyExistsError, NotFoundError, UnavailableError


class Region(Protocol):
    """A registered region as the table sees it."""

    inflight: int  # requests holding it
    unregistering: int  # unregister calls waiting for those requests; new requests are refused meanwhile

    @property
    def name(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    def close(self) -> None:
        """Release the region's memory, once."""


R = TypeVar("R", bound=Region)


class RegionTable(Generic[R]):
    """The regions of one kind, thread-safe. ``label`` names the kind in messages ("shared memory", "CUDA shared
    memory"); ``status_label`` is Triton's wording in a status lookup that finds nothing."""

    def __init__(self, label: str, status_label: str, busy_timeout_s: float) -> None:
        self.label = label
        self.status_label = status_label
        self.busy_timeout_s = busy_timeout_s
        self._regions: dict[str, R] = {}
        self._changed = threading.Condition()

    def names(self) -> set[str]:
        with self._changed:
            return set(self._regions)

    def add(self, name: str, make: Callable[[], R], registered_as: Callable[[R], str] = lambda _region: "") -> None:
        """Register the region ``make`` opens as ``name`` (opened under the lock, so two registrations of one name
        cannot both open memory). ``registered_as`` describes an existing region in the refusal."""
        with self._changed:
            existing = self._regions.get(name)
            if existing is not None:
                raise AlreadyExistsError(f"{self.label} region '{name}' is already registered"
                                         f"{registered_as(existing)}; unregister it first or choose another name")
            self._regions[name] = make()

    def listed(self, name: str = "") -> list[R]:
        """Every region (sorted by name), or the one named."""
        with self._changed:
            if not name:
                return [self._regions[n] for n in sorted(self._regions)]
            region = self._regions.get(name)
            if region is None:
                raise NotFoundError(f"Unable to find {self.status_label} region: '{name}'")
            return [region]

    def unregister(self, name: str = "") -> None:
        """Close the region ``name`` (every region when empty); an unknown name is not an error, as in Triton. A
        region in use is closed once its requests finish; if they do not finish within the busy timeout it stays
        registered and :class:`UnavailableError` says so."""
        with self._changed:
            names = [name] if name else sorted(self._regions)
            regions = [r for r in (self._regions.get(n) for n in names) if r is not None]
            for region in regions:
                region.unregistering += 1
            deadline = time.monotonic() + self.busy_timeout_s
            while any(r.inflight and not r.closed for r in regions) and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(left)
            busy: list[tuple[str, int]] = []
            for region in regions:
                region.unregistering -= 1
                if self._regions.get(region.name) is not region:
                    continue  # another unregister (or shutdown) removed it while we waited; it may be registered anew
                if region.inflight:
                    busy.append((region.name, region.inflight))
                else:
                    del self._regions[region.name]
                    region.close()
        if busy:
            listed = ", ".join(f"'{n}' ({count} request(s))" for n, count in busy)
            raise UnavailableError(f"cannot unregister {self.label} region(s) {listed}: still in use by in-flight "
                                   f"requests after {self.busy_timeout_s:g}s; retry when they finish")

    def close(self) -> None:
        """Close every region now (server shutdown; no request runs any more)."""
        with self._changed:
            for region in self._regions.values():
                region.close()
            self._regions.clear()
            self._changed.notify_all()  # unregister calls still waiting find their regions gone

    def acquire(self, names: Iterable[str], check: Callable[[R], None] = lambda _region: None) -> dict[str, R]:
        """Hold the regions ``names`` for one request (all or none); ``check`` may refuse a region."""
        with self._changed:
            held: dict[str, R] = {}
            for name in sorted(names):
                region = self._regions.get(name)
                if region is None:
                    raise NotFoundError(f"Unable to find shared memory region: '{name}' (register it first)")
                if region.unregistering:
                    raise UnavailableError(f"{self.label} region '{name}' is being unregistered")
                check(region)
                held[name] = region
            for region in held.values():
                region.inflight += 1
            return held

    def release(self, regions: Iterable[R]) -> None:
        with self._changed:
            for region in regions:
                region.inflight -= 1
            self._changed.notify_all()
