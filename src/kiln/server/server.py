"""The Server facade: the in-process, protocol-free core that frontends, the CLI and benchmarks call.

It scans the repositories, loads each model's served versions into engines, validates every request once against
its model's spec, and hands it to that version's scheduler.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kiln import __version__
from kiln.config._generated import model_config_pb2 as pb
from kiln.config.model_dir import ModelDir, open_model_dir
from kiln.config.spec import TensorSpec
from kiln.errors import (
    InvalidArgumentError,
    KilnError,
    ModelNotFoundError,
    ModelNotReadyError,
    UnavailableError,
    UnsupportedError,
)
from kiln.server.instances import cpu_thread_share, create_instances
from kiln.server.model import LoadedModel
from kiln.server.registry import IndexEntry, ModelRecord, ModelState, VersionRecord
from kiln.server.repository import scan_repositories
from kiln.server.request import InferRequest, InferResponse
from kiln.server.scheduler import Scheduler, make_scheduler
from kiln.server.stats import ModelStats, RequestObserver
from kiln.server.validate import validate_request

log = logging.getLogger("kiln.server")

EXTENSIONS = (
    "classification",
    "model_configuration",
    "model_repository",
    "statistics",
    "binary_tensor_data",
    "parameters",
)


@dataclass(frozen=True)
class ServerOptions:
    repositories: list[Path] = field(default_factory=list)
    strict_readiness: bool = True
    model_load_thread_count: int = 4
    autocomplete: bool = True
    default_max_batch_size: int = 4
    # Cores shared by every CPU instance that sets no thread count of its own (None: all cores).
    cpu_threads: int | None = None


@dataclass(frozen=True)
class ModelMetadata:
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    batching: bool


class Server:
    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self._models: dict[str, ModelRecord] = {}
        self._live = False
        self._stopping = False
        self._inflight = 0
        self._observers: list[RequestObserver] = []  # one list shared by every model's statistics

    # -- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Scan the repositories and load every model (control mode none). Failed models stay UNAVAILABLE."""
        scan = scan_repositories([Path(p) for p in self.options.repositories])
        for name in scan.duplicates:
            self._models[name] = ModelRecord(name=name, path=None, reason=scan.reason(name))
            log.error("%s", scan.reason(name))
        with ThreadPoolExecutor(max_workers=max(1, self.options.model_load_thread_count)) as pool:
            opened = list(pool.map(self._open_model, scan.models.items()))
            dirs = [model_dir for _, model_dir in opened if model_dir is not None]
            threads = cpu_thread_share(self.options.cpu_threads,
                                       [(d.spec, len(d.served_versions())) for d in dirs])
            records = list(pool.map(lambda item: self._load_versions(item[0], item[1], threads), opened))
        for record in records:
            self._models[record.name] = record
        self._live = True

    def close(self) -> None:
        """Stop taking requests and release every model after its in-flight requests finish."""
        self._stopping = True
        for record in self._models.values():
            for version in record.versions.values():
                if version.scheduler is not None:
                    version.scheduler.close()
                    version.state, version.scheduler, version.loaded = ModelState.UNAVAILABLE, None, None
        self._live = False

    def begin_shutdown(self) -> None:
        """New inference requests are refused from now on; in-flight ones continue."""
        self._stopping = True

    def add_request_observer(self, observer: RequestObserver) -> None:
        """Call ``observer`` (from worker threads) with the durations of every successful request."""
        self._observers.append(observer)

    @property
    def inflight(self) -> int:
        return self._inflight

    def _open_model(self, item: tuple[str, Path]) -> tuple[ModelRecord, ModelDir | None]:
        name, path = item
        record = ModelRecord(name=name, path=path)
        try:
            model_dir = open_model_dir(path, autocomplete=self.options.autocomplete,
                                       default_max_batch_size=self.options.default_max_batch_size)
        except KilnError as exc:
            record.reason = str(exc)
            log.error("model '%s' failed to load: %s", name, exc)
            return record, None
        record.spec = model_dir.spec
        return record, model_dir

    def _load_versions(self, record: ModelRecord, model_dir: ModelDir | None, threads: int | None) -> ModelRecord:
        if model_dir is None:
            return record
        for version in model_dir.served_versions():
            record.versions[version] = self._load_version(model_dir.spec.name, version, model_dir, threads)
        if not record.versions:
            record.reason = f"model '{record.name}': its version_policy selects no version folder"
        return record

    def _load_version(self, name: str, version: int, model_dir: ModelDir, threads: int | None) -> VersionRecord:
        engines = []
        started = time.monotonic()
        try:
            engines = create_instances(model_dir.spec, model_dir.model_file(version), threads)
            loaded = LoadedModel(model_dir.spec, version, model_dir.path, engines, observers=self._observers)
            scheduler = make_scheduler(loaded)
            loaded.stats.set_load_duration(time.monotonic() - started)
        except (KilnError, OSError) as exc:
            for engine in engines:
                engine.close()
            log.error("model '%s' version %d failed to load: %s", name, version, exc)
            return VersionRecord(version, ModelState.UNAVAILABLE, reason=str(exc))
        return VersionRecord(version, ModelState.READY, loaded=loaded, scheduler=scheduler)

    # -- health and metadata ---------------------------------------------------------------------------------

    def live(self) -> bool:
        return self._live

    def ready(self) -> bool:
        if not self._live or self._stopping:
            return False
        if not self.options.strict_readiness:
            return True
        return all(record.ready_versions() and not record.reason for record in self._models.values())

    def metadata(self) -> dict[str, object]:
        return {"name": "kiln", "version": __version__, "extensions": list(EXTENSIONS)}

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            self._resolve(name, version)
        except KilnError:
            return False
        return True

    def model_metadata(self, name: str, version: str = "") -> ModelMetadata:
        record = self._record(name)
        if version:
            self._resolve(name, version)
        spec = record.spec
        if spec is None:
            raise ModelNotReadyError(f"model '{name}' is not available: {record.reason}")
        versions = [str(v) for v in record.ready_versions()] if not version else [version]
        return ModelMetadata(name=name, versions=versions, platform=spec.platform or spec.backend,
                             inputs=list(spec.inputs), outputs=list(spec.outputs), batching=spec.batching)

    def model_config(self, name: str, version: str = "") -> pb.ModelConfig:
        record = self._record(name)
        if version:
            self._resolve(name, version)
        if record.spec is None:
            raise ModelNotReadyError(f"model '{name}' is not available: {record.reason}")
        return record.spec.config

    def model_statistics(self, name: str = "", version: str = "") -> list[ModelStats]:
        if not name:
            if version:
                raise InvalidArgumentError("statistics: a version was given without a model name")
            records = [v for r in self._sorted_records() for v in self._loaded_versions(r)]
            return [v.loaded.stats.snapshot() for v in records if v.loaded is not None]
        records = [self._resolve(name, version)] if version else self._loaded_versions(self._record(name))
        return [v.loaded.stats.snapshot() for v in records if v.loaded is not None]

    def repository_index(self, ready_only: bool = False) -> list[IndexEntry]:
        entries: list[IndexEntry] = []
        for record in self._sorted_records():
            if not record.versions:
                if not ready_only:
                    entries.append(IndexEntry(record.name, "", ModelState.UNAVAILABLE.value, record.reason))
                continue
            for version, vr in sorted(record.versions.items()):
                if ready_only and vr.state is not ModelState.READY:
                    continue
                entries.append(IndexEntry(record.name, str(version), vr.state.value, vr.reason))
        return entries

    def load_model(self, name: str) -> None:
        raise UnsupportedError(f"explicit model control is not enabled: cannot load '{name}' (this server runs in "
                               f"model control mode 'none'; repository changes need a restart)")

    def unload_model(self, name: str) -> None:
        raise UnsupportedError(f"explicit model control is not enabled: cannot unload '{name}' (this server runs "
                               f"in model control mode 'none')")

    def pending(self, name: str, version: str) -> int:
        """Requests of a model version accepted but not finished."""
        record = self._models.get(name)
        found = record.versions.get(int(version)) if record is not None and version.isdigit() else None
        return found.scheduler.inflight if found is not None and found.scheduler is not None else 0

    # -- inference -------------------------------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        scheduler, batch_size = self._admit(request)
        self._inflight += 1
        try:
            return await scheduler.submit(request, batch_size)
        finally:
            self._inflight -= 1

    def infer_sync(self, request: InferRequest) -> InferResponse:
        """Blocking twin of :meth:`infer` for callers without an event loop."""
        scheduler, batch_size = self._admit(request)
        self._inflight += 1
        try:
            return scheduler.submit_sync(request, batch_size)
        finally:
            self._inflight -= 1

    def _admit(self, request: InferRequest) -> tuple[Scheduler, int]:
        if self._stopping:
            raise UnavailableError("the server is shutting down and takes no new requests")
        record = self._resolve(request.model_name, request.model_version)
        assert record.loaded is not None and record.scheduler is not None
        batch_size = validate_request(record.loaded.spec, request)
        return record.scheduler, batch_size

    # -- lookup ----------------------------------------------------------------------------------------------

    def _record(self, name: str) -> ModelRecord:
        record = self._models.get(name)
        if record is None:
            raise ModelNotFoundError(f"Request for unknown model: '{name}' is not found")
        return record

    def _resolve(self, name: str, version: str) -> VersionRecord:
        record = self._record(name)
        if record.reason and not record.versions:
            raise ModelNotReadyError(f"model '{name}' is not available: {record.reason}")
        if not version:
            ready = record.ready_versions()
            if not ready:
                raise ModelNotReadyError(f"model '{name}' has no version ready to serve")
            return record.versions[ready[-1]]
        try:
            number = int(version)
        except ValueError:
            raise InvalidArgumentError(f"model '{name}': version '{version}' is not a number") from None
        found = record.versions.get(number)
        if found is None:
            raise ModelNotFoundError(f"Request for unknown model: '{name}' version {version} is not found")
        if found.state is not ModelState.READY:
            raise ModelNotReadyError(f"model '{name}' version {version} is not ready: {found.reason or found.state}")
        return found

    def _sorted_records(self) -> list[ModelRecord]:
        return [self._models[name] for name in sorted(self._models)]

    @staticmethod
    def _loaded_versions(record: ModelRecord) -> list[VersionRecord]:
        return [v for _, v in sorted(record.versions.items()) if v.loaded is not None]

