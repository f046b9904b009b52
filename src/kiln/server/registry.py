"""What the server knows about each model and version: state, reason, and the loaded model when ready."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path

from kiln.config.spec import ModelSpec
from kiln.server.model import LoadedModel
from kiln.server.scheduler.base import Scheduler


class ModelState(enum.Enum):
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    LOADING = "LOADING"
    UNLOADING = "UNLOADING"


UNLOADED_REMEMBERED = 32  # versions per model whose reason for no longer being served is kept


@dataclass
class VersionRecord:
    version: int
    state: ModelState
    reason: str = ""
    loaded: LoadedModel | None = None
    scheduler: Scheduler | None = None
    fingerprint: str = ""  # of the version folder and config it was loaded from


@dataclass
class ModelRecord:
    name: str
    path: Path | None
    spec: ModelSpec | None = None
    versions: dict[int, VersionRecord] = field(default_factory=dict)
    reason: str = ""  # why the model as a whole is unavailable (bad config, duplicate name)
    fingerprint: str = ""  # of the model folder as last applied; polling compares against it
    unloaded: dict[int, str] = field(default_factory=dict)  # versions no longer served -> why
    wanted: bool = True  # False once unloaded on purpose: strict readiness no longer waits for it

    def note_unloaded(self, version: int, why: str) -> None:
        """Remember why ``version`` stopped being served, for the index and for requests that name it; only the
        newest :data:`UNLOADED_REMEMBERED` are kept, so a model published every few seconds for weeks stays small."""
        self.unloaded[version] = why
        while len(self.unloaded) > UNLOADED_REMEMBERED:
            del self.unloaded[min(self.unloaded)]

    def ready_versions(self) -> list[int]:
        # A snapshot first: the request path reads this while the manager's thread adds and drops versions, and
        # list() copies the dict in one step where a generator would see it change under its feet.
        return sorted(v for v, record in list(self.versions.items()) if record.state is ModelState.READY)


@dataclass(frozen=True)
class IndexEntry:
    name: str
    version: str
    state: str
    reason: str
