"""Load an ensemble version and keep its readiness in step with the models it calls."""

from __future__ import annotations

import logging
import time

from kiln.config.model_dir import ModelDir
from kiln.config.parse import CONFIG_FILENAME
from kiln.errors import KilnError
from kiln.server.ensemble.binding import SpecLookup, bind_ensemble
from kiln.server.ensemble.plan import plan_ensemble
from kiln.server.ensemble.scheduler import EnsembleScheduler, StepDispatch
from kiln.server.model import LoadedModel
from kiln.server.registry import ModelState, VersionRecord
from kiln.server.stats import RequestObserver

log = logging.getLogger("kiln.server")


def load_ensemble(model_dir: ModelDir, version: int, fingerprint: str, lookup: SpecLookup,
                  dispatch: StepDispatch, observers: list[RequestObserver]) -> VersionRecord:
    """A READY record when the steps form a valid graph and every step's model is ready and agrees with it.
    A graph that cannot run gives an UNAVAILABLE record without a scheduler; a valid graph whose models are
    missing or disagree gives an UNAVAILABLE record that :func:`rebind` turns READY once they are fixed."""
    started = time.monotonic()
    try:
        plan = plan_ensemble(model_dir.spec, str(model_dir.path / CONFIG_FILENAME))
    except KilnError as exc:
        log.error("ensemble '%s' version %d failed to load: %s", model_dir.name, version, exc)
        return VersionRecord(version, ModelState.UNAVAILABLE, reason=str(exc), fingerprint=fingerprint)
    loaded = LoadedModel(model_dir.spec, version, model_dir.path, [], observers=observers)
    record = VersionRecord(version, ModelState.READY, loaded=loaded,
                           scheduler=EnsembleScheduler(loaded, plan, dispatch), fingerprint=fingerprint)
    rebind(record, lookup)
    loaded.stats.set_load_duration(time.monotonic() - started)
    return record


def rebind(record: VersionRecord, lookup: SpecLookup) -> bool:
    """Re-check a loaded ensemble version against its step models; flip it between READY and UNAVAILABLE.
    Returns True when its state changed."""
    scheduler = record.scheduler
    if not isinstance(scheduler, EnsembleScheduler) or record.state not in (ModelState.READY,
                                                                          ModelState.UNAVAILABLE):
        return False
    before = record.state
    try:
        bind_ensemble(scheduler.plan, scheduler.model.spec, lookup)
    except KilnError as exc:
        record.state, record.reason = ModelState.UNAVAILABLE, str(exc)
    else:
        record.state, record.reason = ModelState.READY, ""
    if record.state is not before:
        level = logging.INFO if record.state is ModelState.READY else logging.WARNING
        log.log(level, "ensemble '%s' version %d is now %s%s", scheduler.model.name, record.version,
                record.state.value, f": {record.reason}" if record.reason else "")
    return record.state is not before


def is_ensemble(record_or_dir: object) -> bool:
    spec = getattr(record_or_dir, "spec", None)
    return spec is not None and spec.backend == "ensemble"
