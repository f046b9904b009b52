"""The Server facade: the in-process, protocol-free core that frontends, the CLI and benchmarks call.

It scans the repositories, loads each model's served versions into engines, validates every request once against
its model's spec, and hands it to that version's scheduler.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kiln import __version__
from kiln._flags import flag
from kiln.config._generated import model_config_pb2 as pb
from kiln.config.spec import TensorSpec
from kiln.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    KilnError,
    ModelNotFoundError,
    ModelNotReadyError,
    UnavailableError,
    UnsupportedError,
    VersionUnloadingError,
)
from kiln.server.cuda_ipc import CudaIpcMemory
from kiln.server.cuda_ipc import unavailable_reason as cuda_unavailable_reason
from kiln.server.cuda_shm import CudaRegionStatus, CudaSharedMemoryRegistry, RequestLeases
from kiln.server.ensemble import EnsembleScheduler, StepStats
from kiln.server.manager import CONTROL_MODES, ManagerOptions, RepositoryManager
from kiln.server.registry import IndexEntry, ModelRecord, ModelState, VersionRecord
from kiln.server.repository import scan_repositories
from kiln.server.request import InferRequest, InferResponse
from kiln.server.routing import (
    DEFAULT_KEY,
    ModelRouting,
    RoutingStatus,
    RoutingTable,
    check_weight,
    check_weights,
    parse_fraction,
    parse_version,
)
from kiln.server.scheduler import Scheduler
from kiln.server.shadow import ShadowStats, mirror_request, uses_shared_memory
from kiln.server.shm import RegionStatus, SharedMemoryRegistry, region_names
from kiln.server.staging import check_model_name, parse_config_override, stage_files
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
    "sequence",
    "schedule_policy",
    "model_repository(unload_dependents)",
)


@dataclass(frozen=True)
class ServerOptions(ManagerOptions):
    """The repository manager's options plus the server's own; the flagged ones are ``kiln serve`` flags."""

    strict_readiness: bool = field(default=True, metadata=flag(
        "--strict-readiness", help="ready only when every model is ready (default true)"))
    # Clients may register system shared-memory regions (off by default: see docs/shared-memory.md).
    allow_client_shm: bool = field(default=False, metadata=flag(
        "--allow-client-shm", form="optional_value",
        help="let clients register system shared-memory regions and pass tensors in them (default false: a client "
             "could make the server read and write any shared-memory object the server's user can open)"))

    def __post_init__(self) -> None:
        if self.control_mode not in CONTROL_MODES:
            raise InvalidArgumentError(f"model control mode '{self.control_mode}' is not one of "
                                       f"{', '.join(CONTROL_MODES)}")
        if self.load_models and self.control_mode != "explicit":
            raise InvalidArgumentError("--load-model needs --model-control-mode=explicit")

    def manager_options(self) -> ManagerOptions:
        return self  # the manager's fields are inherited, not copied


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
        if options.control_mode not in CONTROL_MODES:
            raise InvalidArgumentError(f"model control mode '{options.control_mode}' is not one of "
                                       f"{', '.join(CONTROL_MODES)}")
        if options.load_models and options.control_mode != "explicit":
            raise InvalidArgumentError("--load-model needs --model-control-mode=explicit")
        self.options = options
        self._models: dict[str, ModelRecord] = {}
        self._observers: list[RequestObserver] = []  # one list shared by every model's statistics
        self._manager = RepositoryManager(options.manager_options(), self._models, self._observers,
                                          self._dispatch_step)
        self._live = False
        self._stopping = False
        self._inflight = 0
        self._shm = SharedMemoryRegistry() if options.allow_client_shm else None
        self._cuda_registry: CudaSharedMemoryRegistry | None = None  # opened on first use: only GPU hosts need it
        self._cuda_registry_lock = threading.Lock()
        self._ab_routing = RoutingTable()

    # -- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> list[str]:
        """Load the models the control mode asks for. Returns the names that failed (they stay UNAVAILABLE)."""
        failed = self._manager.start()
        self._live = True
        return failed

    def poll(self) -> list[str]:
        """Poll mode: apply repository changes now. Returns the models that changed."""
        return self._manager.poll()

    def load_model(self, name: str, config: str | None = None, files: Mapping[str, bytes] | None = None) -> None:
        """Explicit mode: (re)load a model. ``config`` is a ModelConfig in JSON that replaces config.pbtxt;
        ``files`` maps ``file:<version>/<name>`` to contents, which are staged under the model's folder."""
        check_model_name(name)
        override = parse_config_override(name, config) if config else None
        staged = None
        if files:
            folder = scan_repositories(list(self.options.repositories)).models.get(name)
            if folder is None:
                raise ModelNotFoundError(f"failed to load '{name}': no model folder named '{name}' in the "
                                         f"model repositories")
            staged = stage_files(folder, name, override, files)
            override = None
        try:
            self._manager.load(name, override, staged)
        finally:
            if staged is not None and not self._serves_from(name, staged):
                shutil.rmtree(staged.parent, ignore_errors=True)

    def _serves_from(self, name: str, folder: Path) -> bool:
        record = self._models.get(name)
        return record is not None and any(v.loaded is not None and v.loaded.path == folder
                                          for v in record.versions.values())

    def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        """Explicit mode: stop serving a model; its versions finish their in-flight requests first. Ensembles
        that call it become unavailable. ``unload_dependents`` on an ensemble also unloads the models its steps
        call (those no other loaded ensemble calls)."""
        check_model_name(name)
        self._manager.unload(name, unload_dependents)

    def load_failures(self) -> dict[str, int]:
        """Failed (re)loads per model since start, including reloads that left an older version serving."""
        return dict(self._manager.load_failures)

    def wait_unloaded(self, timeout_s: float | None = None) -> bool:
        """Wait until replaced and unloaded versions have released their engines."""
        return self._manager.retirements.wait(timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Stop taking requests and release every model after its in-flight requests finish (waiting at most
        ``timeout_s`` for them)."""
        self._stopping = True
        self._manager.close(timeout_s)
        if self._shm is not None:
            self._shm.close()
        self.close_cuda_shared_memory()
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

    # -- health and metadata ---------------------------------------------------------------------------------

    def live(self) -> bool:
        return self._live

    def ready(self) -> bool:
        if not self._live or self._stopping:
            return False
        if not self.options.strict_readiness:
            return True
        return all(record.ready_versions() for record in self._models.values() if record.wanted)

    def metadata(self) -> dict[str, object]:
        extensions = [*EXTENSIONS, "system_shared_memory"] if self._shm is not None else list(EXTENSIONS)
        if self._shm is not None and (self._cuda_registry is not None or cuda_unavailable_reason() is None):
            extensions.append("cuda_shared_memory")
        return {"name": "kiln", "version": __version__, "extensions": extensions}

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
        """Every model in the repositories with each version's state and reason (Triton's index)."""
        entries: list[IndexEntry] = []
        known = set(self._models)
        for record in self._sorted_records():
            rows = [(v, r.state.value, r.reason) for v, r in record.versions.items()]
            retired = ModelState.UNLOADING.value, ModelState.UNAVAILABLE.value
            rows += [(v, retired[0] if self._manager.retirements.draining(record.name, v) else retired[1], why)
                     for v, why in record.unloaded.items() if v not in record.versions]
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
            return list(scan_repositories(list(self.options.repositories)).models)
        except KilnError:
            return []

    def pending(self, name: str, version: str) -> int:
        """Requests of a model version accepted but not finished."""
        record = self._models.get(name)
        found = record.versions.get(int(version)) if record is not None and version.isdigit() else None
        return found.scheduler.inflight if found is not None and found.scheduler is not None else 0

    # -- system shared memory --------------------------------------------------------------------------------

    def register_system_shared_memory(self, name: str, key: str, offset: int, byte_size: int) -> None:
        registry = self._shared_memory()
        if self._cuda_registry is not None and name in self._cuda_registry.names():
            raise AlreadyExistsError(f"shared memory region '{name}' is already registered (as CUDA shared "
                                     f"memory); unregister it first or choose another name")
        registry.register(name, key, offset, byte_size)

    def system_shared_memory_status(self, name: str = "") -> list[RegionStatus]:
        return self._shared_memory().status(name)

    def unregister_system_shared_memory(self, name: str = "") -> None:
        """Blocks while the region is in use (bounded): call it from a thread in async code."""
        self._shared_memory().unregister(name)

    def check_client_shm(self) -> None:
        """Raise the "disabled" error unless clients may use system shared memory."""
        self._shared_memory()

    def _shared_memory(self) -> SharedMemoryRegistry:
        if self._shm is None:
            raise UnsupportedError("system shared memory is disabled on this server; start it with "
                                   "`kiln serve --allow-client-shm` to let clients register regions, or send "
                                   "tensor data in the request")
        return self._shm

    def _attach(self, request: InferRequest) -> RequestLeases | None:
        """Fill the request's shared-memory inputs from their regions (system or CUDA) and hold the regions."""
        names = region_names(request)
        if not names:
            return None
        if self._shm is None:
            self._shared_memory()  # raises the "disabled" error
        cuda_names = names & self._cuda_registry.names() if self._cuda_registry is not None else set()
        leases = RequestLeases([])
        try:
            if cuda_names and self._cuda_registry is not None:
                on_device = self._takes_device_tensors(request)
                leases.leases.append(self._cuda_registry.attach(request, cuda_names, on_device))
            system = self._shm.attach(request, skip=cuda_names) if self._shm is not None else None
            if system is not None:
                leases.leases.append(system)
        except BaseException:
            leases.release()
            raise
        return leases

    # -- CUDA shared memory --------------------------------------------------------------------------------------

    def register_cuda_shared_memory(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        registry = self._cuda_shared_memory()
        if self._shm is not None and name in self._shm.names():
            raise AlreadyExistsError(f"shared memory region '{name}' is already registered (as system shared "
                                     f"memory); unregister it first or choose another name")
        registry.register(name, raw_handle, device_id, byte_size)

    def cuda_shared_memory_status(self, name: str = "") -> list[CudaRegionStatus]:
        return self._cuda_shared_memory().status(name)

    def unregister_cuda_shared_memory(self, name: str = "") -> None:
        """Blocks while the region is in use (bounded): call it from a thread in async code."""
        self._cuda_shared_memory().unregister(name)

    def check_cuda_shm(self) -> None:
        """Raise UnsupportedError unless clients may use CUDA shared memory on this server."""
        self._cuda_shared_memory()

    def close_cuda_shared_memory(self) -> None:
        """Close every CUDA region (server shutdown)."""
        if self._cuda_registry is not None:
            self._cuda_registry.close()

    def _cuda_shared_memory(self) -> CudaSharedMemoryRegistry:
        if self._shm is None:
            raise UnsupportedError("CUDA shared memory is disabled on this server; start it with `kiln serve "
                                   "--allow-client-shm` (on a host with a CUDA GPU) to let clients register "
                                   "regions, or send tensor data in the request")
        with self._cuda_registry_lock:
            if self._cuda_registry is None:
                self._cuda_registry = CudaSharedMemoryRegistry(CudaIpcMemory())  # UnsupportedError without a GPU
            return self._cuda_registry

    def _takes_device_tensors(self, request: InferRequest) -> bool:
        """Whether the engine that will run ``request`` computes on torch tensors where they lie; others get host
        copies of CUDA-region inputs."""
        try:
            record = self._resolve(request.model_name, request.model_version)
        except KilnError:
            return False  # host copies suit every engine; _admit reports what is wrong with the request
        return record.loaded is not None and bool(record.loaded.engines) and \
            record.loaded.engines[0].accepts_torch_tensors

    # -- inference -------------------------------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        self._inflight += 1
        lease = None
        try:
            lease = self._attach(request)
            started = time.monotonic_ns()
            scheduler, batch_size = self._admit(request)
            try:
                response = await scheduler.submit(request, batch_size)
            except VersionUnloadingError:
                # Swapped out between lookup and enqueue: the replacement takes it.
                scheduler, batch_size = self._admit(request)
                response = await scheduler.submit(request, batch_size)
            self._after_routing(request, response, started, sync=False)
            if lease is not None:
                lease.finish(request, response)
            return response
        finally:
            if lease is not None:
                lease.release()
            self._inflight -= 1

    def infer_sync(self, request: InferRequest) -> InferResponse:
        """Blocking twin of :meth:`infer` for callers without an event loop."""
        self._inflight += 1
        lease = None
        try:
            lease = self._attach(request)
            started = time.monotonic_ns()
            scheduler, batch_size = self._admit(request)
            try:
                response = scheduler.submit_sync(request, batch_size)
            except VersionUnloadingError:
                scheduler, batch_size = self._admit(request)
                response = scheduler.submit_sync(request, batch_size)
            self._after_routing(request, response, started, sync=True)
            if lease is not None:
                lease.finish(request, response)
            return response
        finally:
            if lease is not None:
                lease.release()
            self._inflight -= 1

    def _admit(self, request: InferRequest) -> tuple[Scheduler, int]:
        if self._stopping:
            raise UnavailableError("the server is shutting down and takes no new requests")
        record = self._route(request) if not request.model_version else self._resolve(request.model_name,
                                                                                       request.model_version)
        assert record.loaded is not None and record.scheduler is not None
        batch_size = validate_request(record.loaded.spec, request)
        return record.scheduler, batch_size

    # -- ensembles -------------------------------------------------------------------------------------------

    async def _dispatch_step(self, request: InferRequest) -> InferResponse:
        """An ensemble step's request: through its model's own scheduler, also while the server shuts down (the
        ensemble request that needs it was accepted before)."""
        record = self._resolve(request.model_name, request.model_version)
        assert record.loaded is not None and record.scheduler is not None
        batch_size = validate_request(record.loaded.spec, request)
        try:
            return await record.scheduler.submit(request, batch_size)
        except VersionUnloadingError:
            record = self._resolve(request.model_name, request.model_version)
            assert record.scheduler is not None
            return await record.scheduler.submit(request, batch_size)

    def ensemble_step_statistics(self, name: str, version: str = "") -> list[StepStats]:
        """Per-step success and failure counts and durations of an ensemble version (each step's model also
        counts the requests in its own statistics)."""
        found = self._resolve(name, version) if version else self._newest_loaded(name)
        if not isinstance(found.scheduler, EnsembleScheduler):
            raise InvalidArgumentError(f"model '{name}' is not an ensemble")
        return found.scheduler.step_statistics()

    def _newest_loaded(self, name: str) -> VersionRecord:
        loaded = self._loaded_versions(self._record(name))
        if not loaded:
            raise ModelNotReadyError(f"model '{name}' has no loaded version")
        return loaded[-1]

    # -- A/B routing -----------------------------------------------------------------------------------------

    def routing(self, name: str) -> RoutingStatus:
        """A model's A/B routing: the weights in force, per-version counts and recent latency percentiles, and what
        shadow traffic found (docs/ab-testing.md)."""
        record = self._record(name)
        return self._routing_of(record).status(record.ready_versions())

    def set_routing(self, name: str, weights: Mapping[str, float] | Mapping[int, float] | None = None,
                    shadow_version: str | int | None = None, shadow_fraction: float | None = None) -> RoutingStatus:
        """Change a model's routing now, without a reload: ``weights`` maps versions to weights (``{}``: serve the
        newest version again); a shadow ``fraction`` of 0 stops shadow traffic. None leaves a setting unchanged.
        These settings replace the config's until the model is reloaded with different ``kiln.*`` parameters."""
        record = self._record(name)
        routing = self._routing_of(record)
        checked: dict[int, float] | None = None
        if weights is not None:
            checked = {}
            for given, weight in weights.items():
                version = parse_version(name, "routing weights", given)
                checked[version] = check_weight(name, "routing weights", version, weight)
            check_weights(name, "routing weights", checked)
        shadow = None if shadow_version is None else parse_version(name, "shadow version", shadow_version)
        fraction = None if shadow_fraction is None else parse_fraction(name, "shadow fraction", shadow_fraction)
        if record.spec is not None and record.spec.config.HasField("sequence_batching"):
            raise InvalidArgumentError(f"model '{name}': A/B routing and shadow traffic need a stateless model; "
                                       f"this one uses sequence_batching")
        routing.update(checked, shadow, fraction)
        return routing.status(record.ready_versions())

    def shadow_statistics(self) -> list[tuple[str, ShadowStats]]:
        """(model, shadow stats) of every model that mirrors requests now (for metrics)."""
        return self._ab.shadows()

    def routing_key_parameter(self, name: str) -> str:
        """The request parameter that carries a model's sticky routing key (frontends fill it from a header)."""
        record = self._models.get(name)
        try:
            return self._routing_of(record).key_parameter if record is not None else DEFAULT_KEY
        except KilnError:
            return DEFAULT_KEY

    @property
    def _ab(self) -> RoutingTable:
        return self._ab_routing

    def _routing_of(self, record: ModelRecord) -> ModelRouting:
        if record.spec is None:
            raise ModelNotReadyError(f"model '{record.name}' is not available: {record.reason}")
        return self._ab.model(record.spec)

    def _route(self, request: InferRequest) -> VersionRecord:
        """The version a request that names none goes to: by the model's weights, else the newest ready one."""
        record = self._record(request.model_name)
        if record.spec is not None:
            ready = record.ready_versions()
            chosen = self._routing_of(record).choose(ready, request.parameters)
            if chosen is None and ready:
                chosen = ready[-1]
            if chosen is not None:
                found = record.versions.get(chosen)
                if found is not None and found.state is ModelState.READY:
                    return found
                return self._resolve(request.model_name, str(chosen))
        return self._resolve(request.model_name, "")

    def _after_routing(self, request: InferRequest, response: InferResponse, started_ns: int, sync: bool) -> None:
        """Count a successful answer for the routing status, then mirror the request to the shadow version if
        the model has one (the mirror runs later and never touches ``response``)."""
        record = self._models.get(request.model_name)
        if record is None or record.spec is None or not response.model_version.isdigit():
            return
        try:
            routing = self._ab.model(record.spec)
        except KilnError:
            return  # bad kiln.* parameters: routed requests report it; explicit versions still serve
        served = int(response.model_version)
        routing.observe(served, not request.model_version, time.monotonic_ns() - started_ns)
        shadow = routing.shadow
        if shadow is None or shadow.version == served or uses_shared_memory(request) or not shadow.sample():
            return
        mirror = mirror_request(request, shadow.version)
        try:
            target = self._resolve(request.model_name, str(shadow.version))
            assert target.loaded is not None and target.scheduler is not None
            batch_size = validate_request(target.loaded.spec, mirror)
        except KilnError:
            shadow.skip()
            return
        scheduler, primary = target.scheduler, list(response.outputs)
        if sync:
            shadow.start_sync(lambda: scheduler.submit_sync(mirror, batch_size), primary)
        else:
            shadow.start(lambda: scheduler.submit(mirror, batch_size), primary)

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
                reasons = [v.reason for _, v in sorted(record.versions.items(), reverse=True) if v.reason]
                raise ModelNotReadyError(f"model '{name}' has no version ready to serve"
                                         + (f": {reasons[0]}" if reasons else ""))
            return record.versions[ready[-1]]
        try:
            number = int(version)
        except ValueError:
            raise InvalidArgumentError(f"model '{name}': version '{version}' is not a number") from None
        found = record.versions.get(number)
        if found is None and number in record.unloaded:
            raise ModelNotReadyError(f"model '{name}' version {version} is not available: {record.unloaded[number]}")
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

