"""The models a server knows, by name: finding the version a request names, loading and unloading them through the
repository manager (manager.py), and what the server answers about them (metadata, config, statistics, index).

Ensemble steps are sent from here too: a step names its model and version, so it needs the lookup and no routing.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

from kiln.config.repository import scan_repositories
from kiln.errors import (
    InvalidArgumentError,
    KilnError,
    ModelNotFoundError,
    ModelNotReadyError,
    VersionUnloadingError,
)
from kiln.server.ensemble import EnsembleScheduler, StepStats
from kiln.server.manager import ManagerOptions, RepositoryManager
from kiln.server.registry import IndexEntry, ModelRecord, ModelState, VersionRecord
from kiln.server.staging import check_model_name, parse_config_override, stage_files
from kiln.server.stats import ModelStats, RequestObserver
from kiln.server.validate import validate_request
from kiln.v2._generated import model_config_pb2 as pb
from kiln.v2.types import InferRequest, InferResponse, ModelMetadata


class ModelCatalog:
    """The model records of one server (shared with its repository manager, which changes them) and every question
    about them. Requests read the records without a lock; the manager swaps whole versions in and out."""

    def __init__(self, options: ManagerOptions) -> None:
        self.repositories = list(options.repositories)
        self.models: dict[str, ModelRecord] = {}
        self.observers: list[RequestObserver] = []  # one list shared by every model's statistics
        self.manager = RepositoryManager(options, self.models, self.observers, self.dispatch_step)

    # -- lifecycle -------------------------------------------------------------------------------------------

    def load(self, name: str, config: str | None, files: Mapping[str, bytes] | None) -> None:
        """(Re)load a model, with ``config`` (ModelConfig JSON) replacing config.pbtxt and ``files`` staged under
        the model's folder (see :meth:`kiln.server.server.Server.load_model`)."""
        check_model_name(name)
        override = parse_config_override(name, config) if config else None
        staged = None
        if files:
            folder = scan_repositories(self.repositories).models.get(name)
            if folder is None:
                raise ModelNotFoundError(f"failed to load '{name}': no model folder named '{name}' in the "
                                         f"model repositories")
            staged = stage_files(folder, name, override, files)
            override = None
        try:
            self.manager.load(name, override, staged)
        finally:
            if staged is not None and not self._serves_from(name, staged):
                shutil.rmtree(staged.parent, ignore_errors=True)

    def _serves_from(self, name: str, folder: Path) -> bool:
        record = self.models.get(name)
        return record is not None and any(v.loaded is not None and v.loaded.path == folder
                                          for v in list(record.versions.values()))

    def unload(self, name: str, unload_dependents: bool) -> None:
        check_model_name(name)
        self.manager.unload(name, unload_dependents)

    def wanted_ready(self) -> bool:
        """Whether every model that should be served has a ready version (strict readiness)."""
        return all(record.ready_versions() for record in self.models.values() if record.wanted)

    # -- what the server answers about models ----------------------------------------------------------------

    def ready(self, name: str, version: str = "") -> bool:
        try:
            self.resolve(name, version)
        except KilnError:
            return False
        return True

    def metadata(self, name: str, version: str = "") -> ModelMetadata:
        record = self.record(name)
        if version:
            self.resolve(name, version)
        spec = record.spec
        if spec is None:
            raise ModelNotReadyError(f"model '{name}' is not available: {record.reason}")
        versions = [str(v) for v in record.ready_versions()] if not version else [version]
        return ModelMetadata(name=name, versions=versions, platform=spec.platform or spec.backend,
                             inputs=list(spec.inputs), outputs=list(spec.outputs), batching=spec.batching)

    def config(self, name: str, version: str = "") -> pb.ModelConfig:
        record = self.record(name)
        if version:
            self.resolve(name, version)
        if record.spec is None:
            raise ModelNotReadyError(f"model '{name}' is not available: {record.reason}")
        return record.spec.config

    def statistics(self, name: str = "", version: str = "") -> list[ModelStats]:
        if not name:
            if version:
                raise InvalidArgumentError("statistics: a version was given without a model name")
            records = [v for r in self._sorted_records() for v in loaded_versions(r)]
            return [v.loaded.stats.snapshot() for v in records if v.loaded is not None]
        records = [self.resolve(name, version)] if version else loaded_versions(self.record(name))
        return [v.loaded.stats.snapshot() for v in records if v.loaded is not None]

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        """Every model in the repositories with each version's state and reason (Triton's index)."""
        entries: list[IndexEntry] = []
        known = set(self.models)
        for record in self._sorted_records():
            rows = [(v, r.state.value, r.reason) for v, r in list(record.versions.items())]
            retired = ModelState.UNLOADING.value, ModelState.UNAVAILABLE.value
            rows += [(v, retired[0] if self.manager.retirements.draining(record.name, v) else retired[1], why)
                     for v, why in list(record.unloaded.items()) if v not in record.versions]
            if not rows:
                rows = [(0, ModelState.UNAVAILABLE.value, record.reason)]
            for version, state, reason in sorted(rows):
                if not ready_only or state == ModelState.READY.value:
                    entries.append(IndexEntry(record.name, str(version) if version else "", state, reason))
        if not ready_only:
            for name in sorted(set(self._scan_names()) - known):
                entries.append(IndexEntry(name, "", ModelState.UNAVAILABLE.value, "not loaded"))
        return sorted(entries, key=lambda e: (e.name, e.version))

    def _scan_names(self) -> list[str]:
        try:
            return list(self.manager.scan().models)
        except KilnError:
            return []

    def pending(self, name: str, version: str) -> int:
        """Requests of a model version accepted but not finished."""
        record = self.models.get(name)
        found = record.versions.get(int(version)) if record is not None and version.isdigit() else None
        return found.scheduler.inflight if found is not None and found.scheduler is not None else 0

    # -- ensembles -------------------------------------------------------------------------------------------

    async def dispatch_step(self, request: InferRequest) -> InferResponse:
        """An ensemble step's request: through its model's own scheduler, also while the server shuts down (the
        ensemble request that needs it was accepted before)."""
        found = self.resolve(request.model_name, request.model_version)
        assert found.loaded is not None and found.scheduler is not None
        batch_size = validate_request(found.loaded.spec, request)
        try:
            return await found.scheduler.submit(request, batch_size)
        except VersionUnloadingError:
            found = self.resolve(request.model_name, request.model_version)
            assert found.scheduler is not None
            return await found.scheduler.submit(request, batch_size)

    def step_statistics(self, name: str, version: str = "") -> list[StepStats]:
        """Per-step success and failure counts and durations of an ensemble version."""
        found = self.resolve(name, version) if version else self._newest_loaded(name)
        if not isinstance(found.scheduler, EnsembleScheduler):
            raise InvalidArgumentError(f"model '{name}' is not an ensemble")
        return found.scheduler.step_statistics()

    def _newest_loaded(self, name: str) -> VersionRecord:
        loaded = loaded_versions(self.record(name))
        if not loaded:
            raise ModelNotReadyError(f"model '{name}' has no loaded version")
        return loaded[-1]

    # -- lookup ----------------------------------------------------------------------------------------------

    def record(self, name: str) -> ModelRecord:
        record = self.models.get(name)
        if record is None:
            raise ModelNotFoundError(f"Request for unknown model: '{name}' is not found")
        return record

    def resolve(self, name: str, version: str) -> VersionRecord:
        """The ready version ``version`` of model ``name`` (the newest ready one when empty)."""
        record = self.record(name)
        if record.reason and not record.versions:
            raise ModelNotReadyError(f"model '{name}' is not available: {record.reason}")
        if not version:
            ready = record.ready_versions()
            if not ready:
                reasons = [v.reason for _, v in sorted(record.versions.items(), reverse=True) if v.reason]
                raise ModelNotReadyError(f"model '{name}' has no version ready to serve"
                                         + (f": {reasons[0]}" if reasons else ""))
            return record.versions[ready[-1]]
        try:
            number = int(version)
        except ValueError:
            # Triton's wording, which its example clients look for.
            raise InvalidArgumentError(f"model '{name}': failed to get model version from specified version string "
                                       f"'{version}': a version is an integer > 0") from None
        found = record.versions.get(number)
        if found is None and number in record.unloaded:
            raise ModelNotReadyError(f"model '{name}' version {version} is not available: {record.unloaded[number]}")
        if found is None:
            raise ModelNotFoundError(f"Request for unknown model: '{name}' version {version} is not found")
        if found.state is not ModelState.READY:
            raise ModelNotReadyError(f"model '{name}' version {version} is not ready: {found.reason or found.state}")
        return found

    def folder(self, name: str, version: str) -> Path:
        """The model folder a ready version was loaded from: the repository's, or where an explicit load with
        files staged it."""
        loaded = self.resolve(name, version).loaded
        if loaded is None:  # a READY version always has its loaded model; this guards the type only
            raise ModelNotReadyError(f"model '{name}' version {version} is not loaded")
        return loaded.path

    def takes_device_tensors(self, request: InferRequest) -> bool:
        """Whether the engine that will run ``request`` computes on torch tensors where they lie; others get host
        copies of CUDA-region inputs."""
        try:
            found = self.resolve(request.model_name, request.model_version)
        except KilnError:
            return False  # host copies suit every engine; admission reports what is wrong with the request
        return found.loaded is not None and bool(found.loaded.engines) and found.loaded.engines[0].accepts_torch_tensors

    def _sorted_records(self) -> list[ModelRecord]:
        return [self.models[name] for name in sorted(self.models)]


def loaded_versions(record: ModelRecord) -> list[VersionRecord]:
    """A model's versions that have a loaded model, oldest first."""
    return [v for _, v in sorted(record.versions.items()) if v.loaded is not None]
