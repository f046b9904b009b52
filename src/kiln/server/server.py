"""The Server facade: the in-process, protocol-free core that frontends, the CLI and benchmarks call.

It scans the repositories, loads each model's served versions into engines, validates every request once against
its model's spec, and hands it to that version's scheduler. The work is done by one collaborator per concern:

- catalog.py: the models by name, their lifecycle (through manager.py), what is known about them, ensemble steps;
- regions.py: the system and CUDA shared-memory regions clients register;
- router.py: the version that serves a request (A/B weights, sticky keys) and shadow traffic;
- infer.py: the request path, shared by :meth:`Server.infer` and :meth:`Server.infer_sync`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kiln import __version__
from kiln._flags import flag
from kiln.engines import host_memory
from kiln.engines.host_memory import SharedHost
from kiln.errors import InvalidArgumentError, KilnError
from kiln.server.catalog import ModelCatalog
from kiln.server.cuda_shm import CudaRegionStatus
from kiln.server.decoupled import DecoupledModelError, StreamItem
from kiln.server.ensemble import StepStats
from kiln.server.infer import InferPath
from kiln.server.manager import CONTROL_MODES, ManagerOptions
from kiln.server.regions import ClientRegions
from kiln.server.registry import IndexEntry
from kiln.server.router import Router
from kiln.server.routing import RoutingStatus
from kiln.server.shadow import ShadowStats
from kiln.server.shm import RegionStatus
from kiln.server.stats import ModelStats, RequestObserver
from kiln.v2._generated import model_config_pb2 as pb
from kiln.v2.types import InferRequest, InferResponse, ModelMetadata

__all__ = ["EXTENSIONS", "DecoupledModelError", "ModelMetadata", "Server", "ServerOptions", "StreamItem"]

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


class Server:
    """The protocol-free server: models, shared-memory regions, routing and inference behind one object. Frontends
    call it from their event loop; blocking methods say so and are called from a thread there."""

    def __init__(self, options: ServerOptions) -> None:
        if options.control_mode not in CONTROL_MODES:
            raise InvalidArgumentError(f"model control mode '{options.control_mode}' is not one of "
                                       f"{', '.join(CONTROL_MODES)}")
        if options.load_models and options.control_mode != "explicit":
            raise InvalidArgumentError("--load-model needs --model-control-mode=explicit")
        self.options = options
        self._catalog = ModelCatalog(options.manager_options())
        self._models = self._catalog.models  # the records by name (tests and benchmarks look at loaded engines)
        self._regions = ClientRegions(options.allow_client_shm)
        self._router = Router(self._catalog)
        self._path = InferPath(self._catalog, self._regions, self._router)
        self._catalog.manager.caller = self  # Python models call the server's other models through it (BLS)
        self._live = False
        self._readiness_held = False

    # -- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> list[str]:
        """Load the models the control mode asks for. Returns the names that failed (they stay UNAVAILABLE)."""
        failed = self._catalog.manager.start()
        self._live = True
        return failed

    def poll(self) -> list[str]:
        """Poll mode: apply repository changes now. Returns the models that changed."""
        return self._catalog.manager.poll()

    def fall_back(self, name: str) -> int | None:
        """A model whose selected versions all failed to load serves the newest older version that loads (see
        RepositoryManager.fall_back); the version, or None."""
        return self._catalog.manager.fall_back(name)

    def load_model(self, name: str, config: str | None = None, files: Mapping[str, bytes] | None = None) -> None:
        """Explicit mode: (re)load a model. ``config`` is a ModelConfig in JSON that replaces config.pbtxt;
        ``files`` maps ``file:<version>/<name>`` to contents, which are staged under the model's folder."""
        self._catalog.load(name, config, files)

    def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        """Explicit mode: stop serving a model; its versions finish their in-flight requests first. Ensembles
        that call it become unavailable. ``unload_dependents`` on an ensemble also unloads the models its steps
        call (those no other loaded ensemble calls)."""
        self._catalog.unload(name, unload_dependents)

    def load_failures(self) -> dict[str, int]:
        """Failed (re)loads per model since start, including reloads that left an older version serving."""
        return dict(self._catalog.manager.load_failures)

    def wait_unloaded(self, timeout_s: float | None = None) -> bool:
        """Wait until the versions that were replaced or unloaded have finished their requests and released their
        engines (and so their memory); False if ``timeout_s`` passed first. A reload or unload returns as soon as
        the change is made, so a script that needs the memory back waits here."""
        return self._catalog.manager.retirements.wait(timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Stop taking requests and release every model after its in-flight requests finish (waiting at most
        ``timeout_s`` for them), then every shared-memory region."""
        self._path.stopping = True
        self._catalog.manager.close(timeout_s)
        self._regions.close()
        self._live = False

    def begin_shutdown(self) -> None:
        """New inference requests are refused from now on; in-flight ones continue."""
        self._path.stopping = True

    def add_request_observer(self, observer: RequestObserver) -> None:
        """Call ``observer`` (from worker threads) with the durations of every successful request."""
        self._catalog.observers.append(observer)

    @property
    def inflight(self) -> int:
        """Inference requests admitted and not yet answered."""
        return self._path.inflight

    # -- health and metadata ---------------------------------------------------------------------------------

    def live(self) -> bool:
        return self._live

    def hold_readiness(self, held: bool) -> None:
        """While held, the server does not answer ready although its models are: kiln serve holds it while its
        frontend processes start, since a client that saw it ready from the first HTTP worker listening would open
        every connection to that worker and keep them there."""
        self._readiness_held = held

    def ready(self) -> bool:
        if not self._live or self._path.stopping or self._readiness_held:
            return False
        return not self.options.strict_readiness or self._catalog.wanted_ready()

    def metadata(self) -> dict[str, object]:
        return {"name": "kiln", "version": __version__, "extensions": [*EXTENSIONS, *self._regions.extensions()]}

    def model_ready(self, name: str, version: str = "") -> bool:
        return self._catalog.ready(name, version)

    def model_metadata(self, name: str, version: str = "") -> ModelMetadata:
        return self._catalog.metadata(name, version)

    def model_folder(self, name: str, version: str = "") -> Path:
        """The folder the served ``version`` (default: the newest ready one) was loaded from, which differs from
        the repository's when an explicit load staged files: what an edge must download to run what is served."""
        return self._catalog.folder(name, version)

    def model_config(self, name: str, version: str = "") -> pb.ModelConfig:
        return self._catalog.config(name, version)

    def model_is_decoupled(self, name: str, version: str = "") -> bool:
        """Whether the model answers a request with any number of responses (False for an unknown model: its
        requests fail with the reason)."""
        try:
            return bool(self._catalog.config(name, version).model_transaction_policy.decoupled)
        except KilnError:
            return False

    def model_statistics(self, name: str = "", version: str = "") -> list[ModelStats]:
        return self._catalog.statistics(name, version)

    def repository_index(self, ready_only: bool = False) -> list[IndexEntry]:
        """Every model in the repositories with each version's state and reason (Triton's index)."""
        return self._catalog.index(ready_only)

    def pending(self, name: str, version: str) -> int:
        """Requests of a model version accepted but not finished."""
        return self._catalog.pending(name, version)

    def ensemble_step_statistics(self, name: str, version: str = "") -> list[StepStats]:
        """Per-step success and failure counts and durations of an ensemble version (each step's model also
        counts the requests in its own statistics)."""
        return self._catalog.step_statistics(name, version)

    # -- shared memory ---------------------------------------------------------------------------------------

    def register_system_shared_memory(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._regions.register_system(name, key, offset, byte_size)

    def system_shared_memory_status(self, name: str = "") -> list[RegionStatus]:
        return self._regions.system_status(name)

    def unregister_system_shared_memory(self, name: str = "") -> None:
        """Blocks while the region is in use (bounded): call it from a thread in async code."""
        self._regions.unregister_system(name)

    def check_client_shm(self) -> None:
        """Raise the "disabled" error unless clients may use system shared memory."""
        self._regions.check_system()

    def register_cuda_shared_memory(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """Raises UnsupportedError, saying why, on a host that cannot open CUDA IPC handles."""
        self._regions.register_cuda(name, raw_handle, device_id, byte_size)

    def cuda_shared_memory_status(self, name: str = "") -> list[CudaRegionStatus]:
        """Also answers on a host without CUDA (no regions there), as Triton does."""
        return self._regions.cuda_status(name)

    def unregister_cuda_shared_memory(self, name: str = "") -> None:
        """Unregister one CUDA region, or all (``""``); an unknown name does nothing, also on a host without CUDA.
        Blocks while the region is in use (bounded): call it from a thread in async code."""
        self._regions.unregister_cuda(name)

    def share_host_memory(self, buffer: memoryview) -> SharedHost:
        """List memory another process writes requests into (a frontend worker's arena): a GPU engine may copy
        inputs lying there to the device in place (kiln.engines.host_memory). Close the handle before unmapping."""
        return host_memory.share(buffer)

    def check_cuda_shm(self) -> None:
        """Raise UnsupportedError unless clients may register CUDA shared memory on this server."""
        self._regions.check_cuda()

    # -- inference -------------------------------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        """Run one request and return its answer (the path frontends take)."""
        return await self._path.infer(request)

    def joined_rows(self, request: InferRequest) -> int:
        """The most rows ``request``, several clients' same-shaped requests stacked (``members``), may have to run
        as one; 0 when its members must run one by one (kiln.v2.joined)."""
        return self._router.joined_rows(request)

    def infer_sync(self, request: InferRequest) -> InferResponse:
        """Run one request and return its answer, blocking the calling thread: for scripts and tests that drive an
        in-process server without an event loop, from any number of threads (docs/serving.md, "In process"). The
        steps are those of :meth:`infer` (regions, routing, the scheduler and its batching); only the waiting
        differs, so a model that launches batches from the event loop serves it on its worker path. Not for an
        event loop's thread, which it would block: call :meth:`infer` there."""
        return self._path.infer_sync(request)

    async def infer_stream(self, request: InferRequest) -> AsyncGenerator[StreamItem, None]:
        """Run one request and yield its answers: a decoupled model's responses as the model sends them (zero or
        more, each a response or an error; the last item has ``final`` set, and may carry neither), any other
        model's one answer. A request that cannot run (unknown model, invalid inputs) raises before the first
        item. :meth:`infer` on a decoupled model raises :class:`DecoupledModelError`."""
        async for item in self._path.infer_stream(request):
            yield item

    def infer_stream_sync(self, request: InferRequest) -> Iterator[StreamItem]:
        """:meth:`infer_stream` for a blocking caller (a Python model's ``exec(decoupled=True)``): the request is
        sent before this returns; iterating blocks for each answer."""
        return self._path.infer_stream_sync(request)

    # -- A/B routing -----------------------------------------------------------------------------------------

    def routing(self, name: str) -> RoutingStatus:
        """A model's A/B routing: the weights in force, per-version counts and recent latency percentiles, and what
        shadow traffic found (docs/ab-testing.md)."""
        return self._router.status(name)

    def set_routing(self, name: str, weights: Mapping[str, float] | Mapping[int, float] | None = None,
                    shadow_version: str | int | None = None, shadow_fraction: float | None = None) -> RoutingStatus:
        """Change a model's routing now, without a reload: ``weights`` maps versions to weights (``{}``: serve the
        newest version again); a shadow ``fraction`` of 0 stops shadow traffic. None leaves a setting unchanged.
        These settings replace the config's until the model is reloaded with different ``kiln.*`` parameters."""
        return self._router.update(name, weights, shadow_version, shadow_fraction)

    def shadow_statistics(self) -> list[tuple[str, ShadowStats]]:
        """(model, shadow stats) of every model that mirrors requests now (for metrics)."""
        return self._router.shadow_statistics()

    def routing_key_parameter(self, name: str) -> str:
        """The request parameter that carries a model's sticky routing key (frontends fill it from a header)."""
        return self._router.key_parameter(name)
