"""The shared-memory regions clients register with a server, system (shm.py) and CUDA (cuda_shm.py), and the leases
that hold a request's regions while it runs.

Both kinds need ``--allow-client-shm``; without it every call says how to turn them on. Names are one namespace
across the two kinds, as in Triton: a name the other kind uses cannot be registered, its status says which kind
holds it, and unregistering it as the wrong kind does nothing. The CUDA registry exists on every host; only
registering a CUDA region needs one that can open CUDA IPC handles (cuda_ipc.py).
"""

from __future__ import annotations

from collections.abc import Callable

from kiln.errors import AlreadyExistsError, NotFoundError, UnsupportedError
from kiln.server.cuda_ipc import CudaIpcMemory
from kiln.server.cuda_shm import CudaRegionStatus, CudaSharedMemoryRegistry, RequestLeases
from kiln.server.shm import RegionStatus, SharedMemoryRegistry, region_names
from kiln.v2.types import InferRequest

SYSTEM_DISABLED = ("system shared memory is disabled on this server; start it with `kiln serve --allow-client-shm` "
                   "to let clients register regions, or send tensor data in the request")
CUDA_DISABLED = ("CUDA shared memory is disabled on this server; start it with `kiln serve --allow-client-shm` (on "
                 "a host with a CUDA GPU) to let clients register regions, or send tensor data in the request")


class ClientRegions:
    """The system and CUDA regions of one server. Thread-safe (each registry is)."""

    def __init__(self, allowed: bool) -> None:
        self.allowed = allowed
        self.system = SharedMemoryRegistry()
        self.cuda = CudaSharedMemoryRegistry(CudaIpcMemory())  # imports nothing of CUDA until a region is registered

    def extensions(self) -> list[str]:
        """The shared-memory extensions this server offers, as server metadata lists them."""
        if not self.allowed:
            return []
        return ["system_shared_memory", "cuda_shared_memory"] if self.cuda.available() else ["system_shared_memory"]

    def close(self) -> None:
        """Release every region now (server shutdown; no request runs any more)."""
        self.system.close()
        self.cuda.close()

    # -- system shared memory --------------------------------------------------------------------------------

    def check_system(self) -> None:
        """Raise the "disabled" error unless clients may use system shared memory."""
        if not self.allowed:
            raise UnsupportedError(SYSTEM_DISABLED)

    def register_system(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self.check_system()
        if name in self.cuda.names():
            raise AlreadyExistsError(_taken(name, "CUDA"))
        self.system.register(name, key, offset, byte_size)

    def system_status(self, name: str = "") -> list[RegionStatus]:
        self.check_system()
        if name and name not in self.system.names() and name in self.cuda.names():
            raise NotFoundError(_other_kind(name, registered="CUDA", asked="system"))
        return self.system.status(name)

    def unregister_system(self, name: str = "") -> None:
        self.check_system()
        self.system.unregister(name)

    # -- CUDA shared memory ----------------------------------------------------------------------------------

    def check_cuda(self) -> None:
        """Raise :class:`UnsupportedError` unless clients may register CUDA regions on this server."""
        if not self.allowed:
            raise UnsupportedError(CUDA_DISABLED)
        self.cuda.check_available()

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self.check_cuda()
        if name in self.system.names():
            raise AlreadyExistsError(_taken(name, "system"))
        self.cuda.register(name, raw_handle, device_id, byte_size)

    def cuda_status(self, name: str = "") -> list[CudaRegionStatus]:
        """Also on a host without CUDA, whose status lists no region."""
        if not self.allowed:
            raise UnsupportedError(CUDA_DISABLED)
        if name and name not in self.cuda.names() and name in self.system.names():
            raise NotFoundError(_other_kind(name, registered="system", asked="CUDA"))
        return self.cuda.status(name)

    def unregister_cuda(self, name: str = "") -> None:
        """Also on a host without CUDA, where there is nothing to unregister."""
        if not self.allowed:
            raise UnsupportedError(CUDA_DISABLED)
        self.cuda.unregister(name)

    # -- use by requests -------------------------------------------------------------------------------------

    def attach(self, request: InferRequest, on_device: Callable[[InferRequest], bool]) -> RequestLeases | None:
        """Fill the request's shared-memory inputs from their regions (system or CUDA) and hold the regions until
        the leases are released. ``on_device`` tells whether the request's engine takes torch tensors where they
        lie (asked only when a CUDA region is named); other engines get host copies of CUDA-region inputs. None
        when the request names no region."""
        names = region_names(request)
        if not names:
            return None
        self.check_system()
        cuda_names = names & self.cuda.names()
        if cuda_names and request.member_rows:
            raise UnsupportedError(f"model '{request.model_name}': a joined request's tensors must lie in system "
                                   f"shared memory, not CUDA region(s) {', '.join(sorted(cuda_names))}; its "
                                   f"members run one by one")
        leases = RequestLeases([])
        try:
            if cuda_names:
                leases.leases.append(self.cuda.attach(request, cuda_names, on_device(request)))
            system = self.system.attach(request, skip=cuda_names)
            if system is not None:
                leases.leases.append(system)
        except BaseException:
            leases.release()
            raise
        return leases


def _taken(name: str, kind: str) -> str:
    return (f"shared memory region '{name}' is already registered (as {kind} shared memory); unregister it first "
            f"or choose another name")


def _other_kind(name: str, registered: str, asked: str) -> str:
    """Triton's answer to a status call of one kind for a region of the other."""
    return f"The region named '{name}' is registered as {registered} shared memory, not {asked} shared memory"
