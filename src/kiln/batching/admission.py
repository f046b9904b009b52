"""Admission for the runners that answer on the event loop (inline.py, launched.py): requests are counted while
they are in, and refused once the model version is unloading, so close() (on another thread) can wait for the
admitted ones."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kiln.errors import VersionUnloadingError


class Admission:
    def __init__(self, model: str, version: int) -> None:
        self.inflight = 0
        self._model = model
        self._version = version
        self._lock = threading.Lock()
        self._closed = False

    def __enter__(self) -> None:
        """Count a request for the ``with`` block (a plain context manager: it runs once per request); raise
        VersionUnloadingError once closing."""
        with self._lock:
            if self._closed:
                raise VersionUnloadingError(f"model '{self._model}' version {self._version} is unloading")
            self.inflight += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.inflight -= 1

    def close(self, timeout_s: float, busy: Callable[[], bool] = lambda: False) -> float:
        """Refuse new requests, then wait until the admitted ones are out and ``busy()`` is false, or the timeout
        passes. Returns the deadline, for the caller's own waits."""
        with self._lock:
            self._closed = True
        deadline = time.monotonic() + timeout_s
        while (self.inflight or busy()) and time.monotonic() < deadline:
            time.sleep(0.001)
        return deadline
