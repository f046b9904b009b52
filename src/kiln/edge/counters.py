"""Thread-safe counters read as one consistent snapshot (the runner's and the capture queue's statistics)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class Counters:
    """Subclasses declare ``int`` fields with defaults; ``add`` and ``snapshot`` take one lock."""

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {name: value for name, value in vars(self).items() if not name.startswith("_")}
