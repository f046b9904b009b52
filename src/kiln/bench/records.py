"""What the load generators write and the measurement reads: one record per finished request, and the load level
that produced them."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import NamedTuple


class ClientTimes(NamedTuple):
    """Client-side costs of one request: building and writing it (send), reading and decoding the answer (recv)."""

    send_ns: int
    recv_ns: int


class RequestRecord(NamedTuple):
    """One request: monotonic start and end, whether it succeeded, and its client times (None where the target
    has no wire, as direct and inprocess)."""

    start_ns: int
    end_ns: int
    ok: bool
    client: ClientTimes | None


@dataclass(frozen=True)
class Level:
    """One load level: ``concurrency`` requests always outstanding, or ``request_rate`` sends per second."""

    concurrency: int | None = None
    request_rate: float | None = None
    distribution: str = "constant"
    max_outstanding: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("a level has either a concurrency or a request rate")

    def describe(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        return f"request rate {self.request_rate:g}/s ({self.distribution})"


class Recorder:
    """Collects records from load threads and hands out those that finished up to a window's end."""

    def __init__(self) -> None:
        self._records: list[RequestRecord] = []
        self._lock = threading.Lock()

    def add(self, record: RequestRecord) -> None:
        with self._lock:
            self._records.append(record)

    def take_until(self, end_ns: int) -> list[RequestRecord]:
        """Every record that ended at or before ``end_ns``; later ones stay for the next window."""
        with self._lock:
            records, self._records = self._records, []
        done = [r for r in records if r.end_ns <= end_ns]
        later = [r for r in records if r.end_ns > end_ns]
        if later:
            with self._lock:
                self._records = later + self._records
        return done

    def take_all(self) -> list[RequestRecord]:
        """Every record so far."""
        with self._lock:
            records, self._records = self._records, []
        return records

    def clear(self) -> None:
        with self._lock:
            self._records = []
