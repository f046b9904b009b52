"""Load, swap and retire model versions without interrupting traffic.

A new version (or a reloaded one) is loaded and warmed up completely before it is published; the version it
replaces stops taking new requests and is released only after its queued and in-flight requests finish, on a
background thread.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kiln.config.model_dir import ModelDir
from kiln.engines.base import Engine, ModelCaller, create_engine
from kiln.errors import KilnError
from kiln.server.instances import create_instances, instance_options
from kiln.server.model import LoadedModel
from kiln.server.registry import ModelState, VersionRecord
from kiln.server.scheduler import make_scheduler
from kiln.server.stats import RequestObserver
from kiln.server.warmup import warm_up

log = logging.getLogger("kiln.server")


def load_version(model_dir: ModelDir, version: int, fingerprint: str, threads: int | None,
                 observers: list[RequestObserver], caller: ModelCaller | None = None) -> VersionRecord:
    """A READY record for ``version``, or an UNAVAILABLE one carrying the reason it failed."""
    name = model_dir.spec.name
    engines: list[Engine] = []
    started = time.monotonic()
    try:
        engines = create_instances(model_dir.spec, model_dir.model_file(version), threads, caller)
        warm_up(model_dir.spec, model_dir.path, engines)
        loaded = LoadedModel(model_dir.spec, version, model_dir.path, engines, observers=observers)
        scheduler = make_scheduler(loaded)
    except (KilnError, OSError) as exc:
        for engine in engines:
            engine.close()
        log.error("model '%s' version %d failed to load: %s", name, version, exc)
        return VersionRecord(version, ModelState.UNAVAILABLE, reason=str(exc), fingerprint=fingerprint)
    loaded.stats.set_load_duration(time.monotonic() - started)
    log.info("model '%s' version %d loaded in %.2fs", name, version, time.monotonic() - started)
    record = VersionRecord(version, ModelState.READY, loaded=loaded, scheduler=scheduler, fingerprint=fingerprint)
    watch_faults(record, engines)
    return record


def watch_faults(record: VersionRecord, engines: list[Engine]) -> None:
    """Engines that can lose their instance and recover (an isolated Python model's child process) report it
    through ``on_fault``: the version's reason says what happened, and the version turns UNAVAILABLE once the
    engine gives up."""

    def note(reason: str, lost: bool) -> None:
        record.reason = reason
        if lost:
            record.state = ModelState.UNAVAILABLE

    for engine in engines:
        if hasattr(engine, "on_fault"):
            engine.on_fault = note


def resize_version(record: VersionRecord, model_dir: ModelDir, fingerprint: str, threads: int | None,
                   observers: list[RequestObserver], caller: ModelCaller | None = None) -> VersionRecord:
    """Same model files, new instance count: keep the running engines, add or drop the difference.

    The old scheduler keeps its engine list while it drains; it is told to release only the surplus."""
    old = record.loaded
    assert old is not None
    options = instance_options(model_dir.spec, threads, caller)
    kept = old.engines[:len(options)]
    added: list[Engine] = []
    try:
        for engine_options in options[len(kept):]:
            added.append(create_engine(model_dir.spec, model_dir.model_file(record.version), engine_options))
        warm_up(model_dir.spec, model_dir.path, added)
        loaded = LoadedModel(model_dir.spec, record.version, model_dir.path, kept + added, observers=observers,
                             stats=old.stats)
        scheduler = make_scheduler(loaded)
    except BaseException:
        for engine in added:
            engine.close()
        raise
    old.release_only = old.engines[len(options):]
    resized = VersionRecord(record.version, ModelState.READY, loaded=loaded, scheduler=scheduler,
                            fingerprint=fingerprint)
    watch_faults(resized, kept + added)
    return resized


@dataclass
class Retirements:
    """Versions being drained and released in the background."""

    _threads: list[threading.Thread] = field(default_factory=list)
    _draining: dict[tuple[str, int], threading.Thread] = field(default_factory=dict)

    def draining(self, model: str, version: int) -> bool:
        """True while a retired version of ``model`` still finishes its requests (shown as UNLOADING)."""
        thread = self._draining.get((model, version))
        return thread is not None and thread.is_alive()

    def retire(self, record: VersionRecord, remove_folder: Path | None = None) -> None:
        """Drain and release ``record`` in the background; then delete ``remove_folder`` (a staged copy that no
        served version uses any more)."""
        scheduler = record.scheduler
        if scheduler is None:
            return
        record.state = ModelState.UNLOADING

        def release() -> None:
            scheduler.close()
            if remove_folder is not None:
                shutil.rmtree(remove_folder, ignore_errors=True)

        thread = threading.Thread(target=release, name=f"kiln-retire-{record.version}", daemon=True)
        thread.start()
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        self._draining = {key: t for key, t in self._draining.items() if t.is_alive()}  # a long run retires many
        if record.loaded is not None:
            self._draining[(record.loaded.name, record.version)] = thread

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until every retired version is released; False when the timeout passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for thread in list(self._threads):
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)
