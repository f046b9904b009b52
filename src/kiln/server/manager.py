"""The repository manager: what should be loaded (desired) against what is (loaded), in three control modes.

- ``none``: load everything at start; the repository is not watched and the API cannot load or unload.
- ``poll``: like none, then :meth:`poll` (called every ``--repository-poll-secs``) applies what changed on disk.
- ``explicit``: load only what start-up names (``*`` for all), then what the API loads and unloads.

Every change goes through one per-model path that loads the new version completely before swapping it in, so a
broken config or a half-copied file leaves the serving version untouched and the failure visible.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kiln._flags import flag
from kiln.config.model_dir import ModelDir, open_model_dir, version_folders
from kiln.config.parse import read_config
from kiln.config.repository import RepositoryScan, restrict, scan_repositories
from kiln.config.spec import ModelSpec
from kiln.engines.base import ModelCaller
from kiln.errors import InvalidArgumentError, KilnError, ModelNotFoundError, ModelNotReadyError, UnsupportedError
from kiln.server.ensemble import LATEST, StepDispatch
from kiln.server.ensemble.loading import is_ensemble, load_ensemble, rebind
from kiln.server.fingerprint import folder_fingerprint, model_fingerprint
from kiln.server.instances import cpu_thread_share
from kiln.server.lifecycle import Retirements, load_version, resize_version
from kiln.server.registry import ModelRecord, ModelState, VersionRecord
from kiln.server.routing import parse_routing_config
from kiln.server.staging import STAGING_FOLDER
from kiln.server.stats import RequestObserver
from kiln.v2._generated import model_config_pb2 as pb

log = logging.getLogger("kiln.server")

CONTROL_MODES = ("none", "poll", "explicit")
_RELOAD_FAILED = "serving; the last reload failed: "


@dataclass(frozen=True)
class ManagerOptions:
    """The repository manager's options; the flagged ones are ``kiln serve`` flags (kiln/_flags.py)."""

    repositories: list[Path] = field(default_factory=list, metadata=flag(
        "--model-repository", "--model-store", help="a model repository root (repeatable; default: the demo "
                                                    "repository)"))
    control_mode: str = field(default="none", metadata=flag(
        "--model-control-mode", choices=CONTROL_MODES,
        help="none: load all at start; poll: also apply repository changes; explicit: only --load-model at start, "
             "then the load/unload API"))
    load_models: tuple[str, ...] = field(default=(), metadata=flag(  # explicit mode start-up; ("*",) = all
        "--load-model", metavar="NAME", help="explicit mode: load this model at start (repeatable; '*' = all)"))
    model_load_thread_count: int = field(default=4, metadata=flag("--model-load-thread-count"))
    # Only these models of the repositories (and the models their ensemble steps call); None: every model. A
    # cluster replica serving part of a repository (kiln.cluster's per-model applications) sees no others.
    serve_models: tuple[str, ...] | None = None
    autocomplete: bool = True
    default_max_batch_size: int = 4
    cpu_threads: int | None = field(default=None, metadata=flag(
        "--cpu-threads", metavar="N", help="cores shared by all CPU model instances that set no thread count "
                                           "(default: all)"))


class RepositoryManager:
    def __init__(self, options: ManagerOptions, models: dict[str, ModelRecord],
                 observers: list[RequestObserver], dispatch: StepDispatch) -> None:
        """``dispatch`` sends an ensemble step's request to its model (the Server's request path)."""
        self.options = options
        self._dispatch = dispatch
        self.models = models  # shared with the Server, which reads it on the request path
        self._observers = observers
        self._lock = threading.RLock()  # API calls and polls one at a time; requests never take it
        self._model_locks: dict[str, threading.Lock] = {}  # one change per model at a time; models load in parallel
        self._threads: int | None = None
        self.retirements = Retirements()
        self.load_failures: dict[str, int] = {}  # per model, since start; a metric makes failed reloads visible
        self.caller: ModelCaller | None = None  # the Server: what Python models' BLS calls reach

    # -- entry points ----------------------------------------------------------------------------------------

    def start(self) -> list[str]:
        """Load what the control mode says to load at start-up. Returns the names that failed."""
        scan = self.scan()
        names = sorted(scan.models)
        if self.options.control_mode == "explicit":
            wanted = set(names) if "*" in self.options.load_models else set(self.options.load_models)
            missing = sorted(wanted - set(names) - set(scan.duplicates))
            for name in missing:
                self.models[name] = ModelRecord(name=name, path=None,
                                                reason=f"model '{name}' is not in any model repository")
            names = [n for n in names if n in wanted]
        self._mark_duplicates(scan)
        dirs = self._open_all({n: scan.models[n] for n in names})
        while True:  # an ensemble named at start brings the models its steps call (Triton does the same)
            called = set().union(*(_step_models(d.spec) for d in dirs.values() if isinstance(d, ModelDir)))
            extra = sorted((called & set(scan.models)) - set(dirs))
            if not extra:
                break
            dirs.update(self._open_all({n: scan.models[n] for n in extra}))
        names = sorted(dirs)
        self._threads = cpu_thread_share(self.options.cpu_threads,
                                         [(d.spec, len(d.served_versions())) for d in dirs.values()
                                          if isinstance(d, ModelDir)])
        # Ensembles last: their steps are checked against the models they call.
        ensembles = [n for n in names if is_ensemble(dirs[n])]
        with ThreadPoolExecutor(max_workers=max(1, self.options.model_load_thread_count)) as pool:
            list(pool.map(lambda n: self._apply(n, scan.models[n], dirs[n]), [n for n in names
                                                                              if n not in ensembles]))
        for name in ensembles:
            self._apply(name, scan.models[name], dirs[name])
        self._rebind_ensembles()
        return sorted(name for name, record in self.models.items() if record.reason)

    def poll(self) -> list[str]:
        """Apply repository changes (poll mode). Returns the names of models that changed."""
        if self.options.control_mode != "poll":
            raise UnsupportedError(f"polling needs --model-control-mode=poll (the mode is "
                                   f"'{self.options.control_mode}')")
        with self._lock:
            scan = self.scan()
            self._mark_duplicates(scan)
            changed: list[str] = []
            for name, path in sorted(scan.models.items(), key=lambda item: self._is_ensemble_folder(item[0])):
                record = self.models.get(name)
                if record is None or record.path != path or record.fingerprint != model_fingerprint(path):
                    changed.append(name)
                    self._apply(name, path, None)
            for name in sorted(set(self.models) - set(scan.models) - set(scan.duplicates)):
                if self.models[name].versions or self.models[name].wanted:
                    changed.append(name)
                    self._unload(name, "removed from the model repository")
            self._rebind_ensembles()
            return changed

    def load(self, name: str, config: pb.ModelConfig | None = None, path: Path | None = None) -> None:
        """Explicit mode: (re)load ``name``, optionally from a staged folder or with a config override."""
        self._require_explicit("load", name)
        with self._lock:
            scanned = self.scan().models
            if self.options.serve_models is not None and name not in scanned:
                raise ModelNotFoundError(f"failed to load '{name}': not among the models this server serves "
                                         f"({', '.join(self.options.serve_models) or 'none'})")
            folder = path or scanned.get(name)
            if folder is None:
                raise ModelNotFoundError(f"failed to load '{name}': no model folder named '{name}' in "
                                         f"{', '.join(str(r) for r in self.options.repositories)}")
            opened = self._open(folder, config)
            if not isinstance(opened, KilnError) and is_ensemble(opened):
                self._load_composing(opened.spec, set())
            self._apply(name, folder, opened, config=config, force=config is not None or path is not None)
            self._rebind_ensembles()
            record = self.models[name]
            if record.reason and not record.ready_versions():
                raise InvalidArgumentError(f"failed to load '{name}': {record.reason}")
            failed = [v.reason for v in record.versions.values() if v.reason.startswith(_RELOAD_FAILED)]
            if failed:
                raise InvalidArgumentError(f"failed to load '{name}' (the previous version keeps serving): "
                                           f"{failed[0][len(_RELOAD_FAILED):]}")

    def unload(self, name: str, unload_dependents: bool = False) -> None:
        """``unload_dependents``: unloading an ensemble also unloads the models its steps call, except those
        another loaded ensemble still calls."""
        self._require_explicit("unload", name)
        with self._lock:
            record = self.models.get(name)
            if record is None:
                raise ModelNotFoundError(f"failed to unload '{name}': the model is not loaded")
            composing = _step_models(record.spec) if unload_dependents else set()
            self._unload(name, "unloaded")
            still_called = set().union(*(_step_models(r.spec) for r in self.models.values() if r.wanted))
            for model in sorted(composing - still_called):
                if model in self.models and self.models[model].wanted:
                    self._unload(model, f"unloaded with the ensemble '{name}'")
            self._rebind_ensembles()

    def fall_back(self, name: str) -> int | None:
        """For a model none of whose selected versions loaded (a corrupt newest version published before this
        server started): serve the newest older version folder that loads, pinned with a ``specific`` version
        policy until the model's folder changes (a poll then applies the repository's own config). Returns the
        version now served, or None when none loads or the model needs no fallback."""
        with self._lock:
            record = self.models.get(name)
            if record is None or record.path is None or record.ready_versions():
                return None
            path = record.path
            try:
                config = read_config(path) or pb.ModelConfig()
            except KilnError:
                return None  # a broken config.pbtxt: no version can load
            for version in sorted(version_folders(path), reverse=True):
                if version in record.versions:
                    continue  # selected by the policy and failed already
                pinned = pb.ModelConfig()
                pinned.CopyFrom(config)
                pinned.version_policy.specific.versions[:] = [version]
                opened = self._open(path, pinned)
                if isinstance(opened, KilnError):
                    continue
                self._apply(name, path, opened, config=pinned)
                if record.ready_versions():
                    self._rebind_ensembles()
                    log.warning("model '%s': serving version %d, the newest that loads", name, version)
                    return version
            return None

    def close(self, timeout_s: float | None = None) -> None:
        with self._lock:
            for name in list(self.models):
                self._unload(name, "the server is shutting down")
        self.retirements.wait(timeout_s)

    # -- the one change path -------------------------------------------------------------------------------

    def _apply(self, name: str, path: Path, opened: ModelDir | KilnError | None,
               config: pb.ModelConfig | None = None, force: bool = False) -> None:
        with self._model_locks.setdefault(name, threading.Lock()):
            record = self.models.get(name) or ModelRecord(name=name, path=path)
            self.models.setdefault(name, record)
            fingerprint = model_fingerprint(path)
            model_dir = opened if opened is not None else self._open(path, config)
            if isinstance(model_dir, KilnError):
                self._keep_serving(record, model_dir)
                return
            desired = model_dir.served_versions()
            for version in desired:
                self._apply_version(record, model_dir, version, force)
            self._retire_replaced(record, desired)
            failures = [r.reason for r in record.versions.values() if r.state is not ModelState.READY]
            failures += [r.reason for r in record.versions.values() if r.reason.startswith(_RELOAD_FAILED)]
            if failures:
                self.load_failures[name] = self.load_failures.get(name, 0) + 1
            record.spec, record.path, record.wanted = model_dir.spec, path, True
            record.reason = failures[0] if failures and not record.ready_versions() else ""
            if not desired:
                record.reason = f"model '{name}': its version_policy selects no version folder"
            # Remember what was applied; a failed version is retried on the next poll.
            record.fingerprint = fingerprint if not failures else ""

    def _apply_version(self, record: ModelRecord, model_dir: ModelDir, version: int, force: bool) -> None:
        fingerprint = _version_fingerprint(model_dir, version)
        current = record.versions.get(version)
        if current is not None and current.state is ModelState.READY and not force:
            if current.fingerprint == fingerprint:
                current.reason = ""
                return
            if _only_instances_changed(current, model_dir, fingerprint):
                try:
                    resized = resize_version(current, model_dir, fingerprint, self._threads, self._observers,
                                             self.caller)
                except (KilnError, OSError) as exc:
                    current.reason = f"{_RELOAD_FAILED}{exc}"
                    return
                record.versions[version] = resized
                self.retirements.retire(current)  # keeps its files: the resized version uses them
                log.info("model '%s' version %d: instance count adjusted in place", record.name, version)
                return
        if current is None or current.state is not ModelState.READY:
            record.versions[version] = VersionRecord(version, ModelState.LOADING, fingerprint=fingerprint)
        if is_ensemble(model_dir):
            fresh = load_ensemble(model_dir, version, fingerprint, self._step_spec, self._dispatch, self._observers)
        else:
            fresh = load_version(model_dir, version, fingerprint, self._threads, self._observers, self.caller)
        if fresh.state is not ModelState.READY and current is not None and current.state is ModelState.READY:
            current.reason = f"{_RELOAD_FAILED}{fresh.reason}"
            record.versions[version] = current
            return
        record.versions[version] = fresh
        record.unloaded.pop(version, None)
        if current is not None and current is not fresh:
            self.retirements.retire(current, self._unused_staging(record, current))

    def _retire_replaced(self, record: ModelRecord, desired: list[int]) -> None:
        """Retire the versions the policy no longer selects, unless none of those it selects loaded: then the
        ready ones keep serving (a corrupt new version never takes the model down) and say why."""
        replaced = [v for v in record.versions if v not in desired]
        failed = [record.versions[v] for v in desired if record.versions[v].state is not ModelState.READY]
        if failed and len(failed) == len(desired):
            for version in [v for v in replaced if record.versions[v].state is ModelState.READY]:
                record.versions[version].reason = f"{_RELOAD_FAILED}version {failed[-1].version}: {failed[-1].reason}"
                replaced.remove(version)
        for version in replaced:
            self._retire(record, version, "no longer selected by the version policy")

    def _keep_serving(self, record: ModelRecord, error: KilnError) -> None:
        log.error("model '%s' failed to load: %s", record.name, error)
        self.load_failures[record.name] = self.load_failures.get(record.name, 0) + 1
        if record.ready_versions():
            for version in record.versions.values():
                version.reason = f"{_RELOAD_FAILED}{error}"
            record.fingerprint = ""
        else:
            record.reason = str(error)

    def _unload(self, name: str, why: str) -> None:
        record = self.models.get(name)
        if record is None:
            return
        for version in list(record.versions):
            self._retire(record, version, why)
        record.reason = why
        record.fingerprint = ""
        record.wanted = False

    def _retire(self, record: ModelRecord, version: int, why: str) -> None:
        old = record.versions.pop(version)
        record.note_unloaded(version, why)
        self.retirements.retire(old, self._unused_staging(record, old))

    @staticmethod
    def _unused_staging(record: ModelRecord, old: VersionRecord) -> Path | None:
        """The staged copy ``old`` was loaded from, when no version still served comes from it."""
        folder = old.loaded.path if old.loaded is not None else None
        if folder is None or STAGING_FOLDER not in folder.parts:
            return None
        in_use = any(v.loaded is not None and v.loaded.path == folder for v in record.versions.values())
        # <model>/.kiln-staging/<n>/<model>: remove the numbered folder.
        return None if in_use else (folder.parent if folder.parent.parent.name == STAGING_FOLDER else folder)

    # -- ensembles -------------------------------------------------------------------------------------------

    def _step_spec(self, name: str, version: int) -> ModelSpec:
        """The spec an ensemble step reaches: ``version`` of ``name``, or its newest ready version."""
        record = self.models.get(name)
        if record is None or not record.wanted:
            raise ModelNotFoundError(f"model '{name}' is not loaded" + (f" ({record.reason})" if record else ""))
        numbers = record.ready_versions() if version == LATEST else [version]
        found = record.versions.get(numbers[-1]) if numbers else None
        if found is None or found.state is not ModelState.READY or found.loaded is None:
            which = "no version" if version == LATEST else f"version {version}"
            why = (found.reason if found is not None else "") or record.reason or record.unloaded.get(version, "")
            raise ModelNotReadyError(f"model '{name}' has {which} ready" + (f": {why}" if why else ""))
        return found.loaded.spec

    def _rebind_ensembles(self) -> None:
        """Re-check every ensemble against the models it calls (after any load, unload or reload)."""
        for record in self.models.values():
            if is_ensemble(record) and any(rebind(v, self._step_spec) for v in record.versions.values()):
                ready = record.ready_versions()
                failed = [v.reason for v in record.versions.values() if v.state is not ModelState.READY]
                record.reason = "" if ready or not failed else failed[0]

    def _load_composing(self, spec: ModelSpec, seen: set[str]) -> None:
        """Explicit mode: loading an ensemble loads the models its steps call that are not loaded yet."""
        scan = self.scan()
        for model in sorted(_step_models(spec) - seen):
            seen.add(model)
            record = self.models.get(model)
            if (record is not None and record.wanted and record.ready_versions()) or model not in scan.models:
                continue  # a model missing from the repositories is reported when the ensemble binds
            opened = self._open(scan.models[model], None)
            if not isinstance(opened, KilnError) and is_ensemble(opened):
                self._load_composing(opened.spec, seen)
            self._apply(model, scan.models[model], opened)

    def _is_ensemble_folder(self, name: str) -> bool:
        record = self.models.get(name)
        return record is not None and is_ensemble(record)

    # -- helpers ---------------------------------------------------------------------------------------------

    def scan(self) -> RepositoryScan:
        """The model folders this server may serve (all, or the part ``serve_models`` names)."""
        scan = scan_repositories(list(self.options.repositories))
        if self.options.serve_models is None:
            return scan
        # The steps of the ensembles loaded now stay too: a newly published ensemble config that is broken, or
        # names other steps and then fails to load, leaves the served ensemble and so its steps in place.
        called = set().union(*(_step_models(r.spec) for r in list(self.models.values()) if r.wanted))
        return restrict(scan, (*self.options.serve_models, *sorted(called)))

    def _mark_duplicates(self, scan: RepositoryScan) -> None:
        for name in scan.duplicates:
            if name in self.models:
                self._unload(name, scan.reason(name))
            self.models[name] = ModelRecord(name=name, path=None, reason=scan.reason(name))
            log.error("%s", scan.reason(name))

    def _open(self, path: Path, config: pb.ModelConfig | None) -> ModelDir | KilnError:
        try:
            model_dir = open_model_dir(path, autocomplete=self.options.autocomplete,
                                       default_max_batch_size=self.options.default_max_batch_size, config=config)
            parse_routing_config(model_dir.spec)  # bad kiln.ab.* / kiln.shadow.* values fail the load
            return model_dir
        except KilnError as exc:
            return exc

    def _open_all(self, paths: dict[str, Path]) -> dict[str, ModelDir | KilnError]:
        with ThreadPoolExecutor(max_workers=max(1, self.options.model_load_thread_count)) as pool:
            results = pool.map(lambda item: (item[0], self._open(item[1], None)), paths.items())
            return dict(results)

    def _require_explicit(self, action: str, name: str) -> None:
        if self.options.control_mode != "explicit":
            raise UnsupportedError(f"cannot {action} '{name}': explicit model control is not enabled (this server "
                                   f"runs in model control mode '{self.options.control_mode}'; start it with "
                                   f"--model-control-mode=explicit)")


def _version_fingerprint(model_dir: ModelDir, version: int) -> str:
    config = model_dir.spec.config.SerializeToString(deterministic=True).hex()
    return f"{folder_fingerprint(model_dir.versions[version])}:{config}"


def _only_instances_changed(current: VersionRecord, model_dir: ModelDir, fingerprint: str) -> bool:
    if current.loaded is None or current.fingerprint.split(":")[0] != fingerprint.split(":")[0]:
        return False
    old, new = pb.ModelConfig(), pb.ModelConfig()
    old.CopyFrom(current.loaded.spec.config)
    new.CopyFrom(model_dir.spec.config)
    old_kinds = [(g.kind, list(g.gpus)) for g in old.instance_group]
    new_kinds = [(g.kind, list(g.gpus)) for g in new.instance_group]
    old.ClearField("instance_group")
    new.ClearField("instance_group")
    return old == new and old_kinds == new_kinds


def _step_models(spec: ModelSpec | None) -> set[str]:
    if spec is None or spec.backend != "ensemble":
        return set()
    return {step.model_name for step in spec.config.ensemble_scheduling.step}
