"""CUDA shared-memory regions registered by clients (Triton's CUDA shared-memory extension), protocol-free.

A region is device memory a client exported as a CUDA IPC handle (``raw_handle``, ``device_id``, ``byte_size``),
opened once at registration (see cuda_ipc.py) and kept as a 1-D ``torch.uint8`` tensor. A request input that names
a region becomes, without any copy, a torch CUDA tensor view of it when the model's engine takes torch tensors
(the PyTorch backend runs it where it lies); any other engine gets a host copy (numpy), since it computes on the
host anyway. Outputs asked for in a region are copied into it on the device (device-to-device when the engine
returned device tensors, host-to-device otherwise) and the device is synchronized before the response goes out,
so the client reads complete data.

On a host that cannot open CUDA IPC handles (no GPU, no cuda-python or cupy, no torch) the registry still exists
and answers status (no regions) and unregister (nothing to do), as Triton does: the official client examples
unregister every CUDA region before they start. Only registering a region fails there, saying why.

Safety: every offset and size is checked against the region. A region counts the requests using it, so
unregistering a busy region waits (bounded) and then fails, instead of closing memory a request still reads;
device tensors are turned into host arrays before a request lets go of its regions. Unlike system shared memory
nothing can shrink a region behind the server's back: the client cannot free memory another process has open.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.errors import InvalidArgumentError, UnsupportedError
from kiln.server.cuda_ipc import RegionMemory
from kiln.server.region_table import RegionTable
from kiln.server.shm import BUSY_TIMEOUT_S, RegionLease, check_window
from kiln.tensor import DataType, decode_bytes, element_count, encode_bytes
from kiln.v2.types import InferRequest, InferResponse, OutputTensor, SharedMemoryRef


@dataclass(frozen=True)
class CudaRegionStatus:
    name: str
    device_id: int
    byte_size: int


@dataclass(eq=False)
class _CudaRegion:
    status: CudaRegionStatus
    memory: Any  # 1-D torch.uint8 tensor over the region
    opener: RegionMemory  # what opened it, and closes it
    inflight: int = 0
    unregistering: int = 0
    closed: bool = False

    @property
    def name(self) -> str:
        return self.status.name

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.opener.close(self.memory)


class CudaSharedMemoryRegistry:
    """The registered CUDA shared-memory regions of one server. Thread-safe."""

    def __init__(self, memory: RegionMemory, busy_timeout_s: float = BUSY_TIMEOUT_S) -> None:
        self._memory = memory
        self._table: RegionTable[_CudaRegion] = RegionTable("CUDA shared memory", "cuda shared memory",
                                                             busy_timeout_s)

    def names(self) -> set[str]:
        return self._table.names()

    def available(self) -> bool:
        """Whether regions can be registered on this host."""
        return self._memory.unavailable_reason() is None

    def check_available(self) -> None:
        """Raise :class:`UnsupportedError`, saying why, unless regions can be registered on this host."""
        reason = self._memory.unavailable_reason()
        if reason is not None:
            raise UnsupportedError(f"CUDA shared memory is not supported on this server: {reason}")

    def register(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """Open the client's IPC handle (``raw_handle``) on ``device_id`` as region ``name`` of ``byte_size``."""
        self.check_available()
        what = f"CUDA shared memory region '{name}'"
        if not name:
            raise InvalidArgumentError("a CUDA shared memory region needs a non-empty name")
        if type(device_id) is not int or device_id < 0:
            raise InvalidArgumentError(f"{what}: device_id must be a non-negative integer, got {device_id!r}")
        if type(byte_size) is not int or byte_size <= 0:
            raise InvalidArgumentError(f"{what}: byte_size must be a positive integer, got {byte_size!r}")

        def open_region() -> _CudaRegion:
            memory = self._memory.open(raw_handle, device_id, byte_size, f"cannot register {what}")
            return _CudaRegion(CudaRegionStatus(name, device_id, byte_size), memory, self._memory)

        self._table.add(name, open_region)

    def status(self, name: str = "") -> list[CudaRegionStatus]:
        """Every region (sorted by name), or the one named. Also on a host without CUDA, which has none."""
        return [region.status for region in self._table.listed(name)]

    def unregister(self, name: str = "") -> None:
        """Close the region ``name`` (every region when empty); an unknown name is not an error, as in Triton, also
        on a host without CUDA. Waits (bounded) for the requests using it, as system shared memory does."""
        self._table.unregister(name)

    def close(self) -> None:
        """Close every region now (server shutdown; no request runs any more)."""
        self._table.close()

    # -- use by requests -------------------------------------------------------------------------------------

    def attach(self, request: InferRequest, names: Iterable[str], on_device: bool) -> CudaRegionLease:
        """Fill the request's inputs that name one of ``names`` from their regions: torch CUDA views when
        ``on_device`` (the engine takes torch tensors), host copies otherwise. The regions stay held until the
        lease is released."""
        lease = CudaRegionLease(self, self._table.acquire(names))
        try:
            for tensor in request.inputs:
                ref = tensor.shared_memory
                if ref is not None and ref.region in lease.regions:
                    where = f"model '{request.model_name}': input '{tensor.name}'"
                    tensor.data = lease.read(ref, tensor.datatype, tensor.shape, where, on_device)
            for output in request.outputs:
                ref = output.shared_memory
                if ref is not None and ref.region in lease.regions:
                    lease.window(ref, f"model '{request.model_name}': output '{output.name}'")
        except BaseException:
            lease.release()
            raise
        return lease


@dataclass(eq=False)
class CudaRegionLease:
    """The CUDA regions one request uses, held until :meth:`release`."""

    registry: CudaSharedMemoryRegistry
    regions: dict[str, _CudaRegion]
    released: bool = field(default=False)

    def window(self, ref: SharedMemoryRef, where: str) -> tuple[_CudaRegion, int]:
        region = self.regions[ref.region]
        check_window(ref, region.status.byte_size, where)
        return region, ref.offset

    def read(self, ref: SharedMemoryRef, datatype: DataType, shape: tuple[int, ...], where: str,
             on_device: bool) -> Any:
        region, start = self.window(ref, where)
        raw = region.memory[start:start + ref.byte_size]
        count = element_count(shape)
        if datatype is DataType.BYTES:  # length-prefixed strings are parsed on the host
            try:
                return decode_bytes(memoryview(raw.cpu().numpy()), count).reshape(shape)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"{where} (BYTES in CUDA shared memory region '{ref.region}'): "
                                           f"{exc.message}") from None
        itemsize = datatype.numpy_dtype.itemsize
        if ref.byte_size != count * itemsize:
            raise InvalidArgumentError(f"{where}: shared_memory_byte_size is {ref.byte_size} but shape "
                                       f"{list(shape)} of {datatype.wire_name} needs {count * itemsize} bytes")
        if not on_device:
            return raw.cpu().numpy().view(datatype.numpy_dtype).reshape(shape)
        if start % itemsize:
            raise InvalidArgumentError(f"{where}: shared_memory_offset {ref.offset} in CUDA shared memory region "
                                       f"'{ref.region}' is not a multiple of the {itemsize}-byte size of "
                                       f"{datatype.wire_name} elements, so the input cannot be read in place")
        return raw.view(torch_dtype(datatype)).view(shape)

    def finish(self, request: InferRequest, response: InferResponse) -> None:
        """Before :meth:`release`: copy every output asked for in one of these regions into it (on the device),
        then make every other output a host array (the frontends encode numpy; a device tensor may also be a
        view of region memory)."""
        wanted = {o.name: o.shared_memory for o in request.outputs
                  if o.shared_memory is not None and o.shared_memory.region in self.regions}
        outputs = [self._write(output, wanted[output.name], response.model_name) if output.name in wanted
                   else replace(output, data=host_array(output.data, output.datatype))
                   for output in response.outputs]
        devices = {r.memory.device for r in self.regions.values() if r.memory.is_cuda}
        if wanted and devices:
            import torch

            for device in devices:
                torch.cuda.synchronize(device)  # the client reads the region as soon as the response arrives
        response.outputs = outputs

    def _write(self, output: OutputTensor, ref: SharedMemoryRef, model: str) -> OutputTensor:
        import torch

        where = f"model '{model}': output '{output.name}'"
        region, start = self.window(ref, where)
        if output.datatype is DataType.BYTES:
            source = torch.from_numpy(np.frombuffer(encode_bytes(host_array(output.data, output.datatype)),
                                                    np.uint8))
        elif isinstance(output.data, torch.Tensor):
            source = output.data.detach().to(torch_dtype(output.datatype)).contiguous().reshape(-1) \
                .view(torch.uint8)
        else:
            array = np.ascontiguousarray(output.data, dtype=output.datatype.numpy_dtype).reshape(-1)
            source = torch.from_numpy(array.view(np.uint8))
        size = int(source.numel())
        if size > ref.byte_size:
            raise InvalidArgumentError(f"{where} has {size} bytes (shape {list(output.shape)}) but "
                                       f"shared_memory_byte_size in CUDA region '{ref.region}' is {ref.byte_size}")
        region.memory[start:start + size].copy_(source, non_blocking=False)
        parameters = {**output.parameters, "shared_memory_region": ref.region, "shared_memory_byte_size": size}
        if ref.offset:
            parameters["shared_memory_offset"] = ref.offset
        # The data is in the region now; the response carries none (and no device tensor outlives the lease).
        return replace(output, data=np.empty(0, output.datatype.numpy_dtype), parameters=parameters,
                       shared_memory=ref)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.registry._table.release(self.regions.values())


def torch_dtype(datatype: DataType) -> Any:
    """The torch dtype with the same bits as ``datatype`` (numpy's dtype names are torch's attribute names)."""
    import torch

    return getattr(torch, datatype.numpy_dtype.name)


def host_array(data: Any, datatype: DataType) -> npt.NDArray[Any]:
    """``data`` as a numpy array: torch tensors (on any device) are copied to the host, bit for bit (numpy has no
    bfloat16 of its own, so the bits go through uint8)."""
    if not hasattr(data, "detach") or datatype is DataType.BYTES:
        return np.asarray(data)
    import torch

    tensor = data.detach().to(torch_dtype(datatype)).contiguous()
    host: npt.NDArray[Any] = tensor.reshape(-1).view(torch.uint8).cpu().numpy()
    return host.view(datatype.numpy_dtype).reshape(tuple(tensor.shape))


@dataclass(eq=False)
class RequestLeases:
    """Every region lease of one request (CUDA first: it turns device outputs into host arrays, which the system
    shared-memory lease then writes or checks)."""

    leases: list[CudaRegionLease | RegionLease]

    def finish(self, request: InferRequest, response: InferResponse) -> None:
        for lease in self.leases:
            lease.finish(request, response)

    def release(self) -> None:
        for lease in self.leases:
            lease.release()
