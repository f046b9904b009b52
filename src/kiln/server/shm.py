"""System shared-memory regions registered by clients (Triton's system shared-memory extension), protocol-free.

A region is a named window (``offset``, ``byte_size``) into a POSIX shared-memory object that the client created
(``key``, e.g. ``/input_simple``, which lives at ``/dev/shm/input_simple`` on Linux). Registering maps the object
into the server; request inputs that name a region become read-only numpy views over the mapping (no copy), which
a GPU engine copies to the device from the mapping itself (it is listed in kiln.engines.host_memory), and outputs
that name one are written into it.

Safety: every offset and size is checked against the region; keys must name regular files directly (no
symbolic links, so a region cannot become a window onto another file). A region counts the requests using it,
so unregistering a busy region waits (bounded) and then fails instead of unmapping memory under a running
request, and outputs that are views of region memory are copied before the request lets go of its regions.
When a request acquires its regions, and again before it writes an output, the key is checked to still name the
object that was mapped at its full size. That check is best-effort: it turns an object destroyed, replaced or
shrunk *before* the check into a clear error, but a client that truncates the object while a request is reading
or writing it can still crash the server (SIGBUS); only trusted clients may use shared memory.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import threading
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.engines import host_memory
from kiln.engines.host_memory import SharedHost
from kiln.errors import InvalidArgumentError, NotFoundError, UnavailableError
from kiln.server.region_table import RegionTable
from kiln.tensor import DataType, decode_bytes, element_count, encode_bytes
from kiln.v2.types import InferRequest, InferResponse, InputTensor, OutputTensor, SharedMemoryRef

SHM_DIR = Path("/dev/shm")
"""Where Linux keeps POSIX shared-memory objects (``shm_open(key)`` opens ``/dev/shm/<key without '/'>``)."""

BUSY_TIMEOUT_S = 5.0
"""How long unregistering waits for the in-flight requests that use a region before it fails."""


@dataclass(frozen=True)
class RegionStatus:
    name: str
    key: str
    offset: int
    byte_size: int


@dataclass(eq=False)
class _Region:
    status: RegionStatus
    path: Path
    fd: int
    memory: mmap.mmap
    inode: tuple[int, int]  # (st_dev, st_ino) of the object when it was mapped
    listed: SharedHost  # inputs read from the mapping may go to a GPU from where they lie (engines/host_memory.py)
    inflight: int = 0
    unregistering: int = 0  # unregister calls waiting for in-flight requests; new requests are refused meanwhile
    closed: bool = False
    guard: threading.Lock = field(default_factory=threading.Lock)  # orders close() against reads and writes

    @property
    def name(self) -> str:
        return self.status.name

    def close(self) -> None:
        """Unmap and close the descriptor, once: a second close must not close a descriptor number reused since."""
        with self.guard:
            if self.closed:
                return
            self.closed = True
            self.listed.close()  # an engine that pinned the mapping lets go of it first
            try:
                self.listed.buffer.release()
                self.memory.close()
            except BufferError:
                pass  # a numpy view still exists somewhere; the mapping goes when the last one is collected
            os.close(self.fd)

    @contextmanager
    def open_for(self, where: str) -> Iterator[mmap.mmap]:
        """The mapping, kept open for the duration; a closed region is a kiln error, not a closed-mmap ValueError."""
        with self.guard:
            _check_open(self, where)
            yield self.memory


class SharedMemoryRegistry:
    """The registered system shared-memory regions of one server. Thread-safe."""

    def __init__(self, shm_dir: Path = SHM_DIR, busy_timeout_s: float = BUSY_TIMEOUT_S) -> None:
        self._dir = shm_dir
        self._table: RegionTable[_Region] = RegionTable("shared memory", "system shared memory", busy_timeout_s)

    # -- registration ----------------------------------------------------------------------------------------

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map ``byte_size`` bytes at ``offset`` of the shared-memory object ``key`` as region ``name``."""
        what = f"shared memory region '{name}'"
        if not name:
            raise InvalidArgumentError("a shared memory region needs a non-empty name")
        if type(offset) is not int or offset < 0:
            raise InvalidArgumentError(f"{what}: offset must be a non-negative integer, got {offset!r}")
        if type(byte_size) is not int or byte_size <= 0:
            raise InvalidArgumentError(f"{what}: byte_size must be a positive integer, got {byte_size!r}")
        path = self._path(name, key)
        self._table.add(name, lambda: _map(RegionStatus(name, key, offset, byte_size), path),
                        lambda existing: f" (key '{existing.status.key}')")

    def names(self) -> set[str]:
        return self._table.names()

    def status(self, name: str = "") -> list[RegionStatus]:
        """Every region (sorted by name), or the one named."""
        return [region.status for region in self._table.listed(name)]

    def unregister(self, name: str = "") -> None:
        """Unmap the region ``name`` (every region when empty). An unknown name is not an error, as in Triton.
        A region in use by in-flight requests is unmapped once they finish; if they do not finish within the
        busy timeout the region stays registered and :class:`UnavailableError` says so."""
        self._table.unregister(name)

    def close(self) -> None:
        """Unmap every region now (server shutdown; no request runs any more)."""
        self._table.close()

    def _path(self, name: str, key: str) -> Path:
        # A POSIX shm name is one component: refuse anything that could reach outside the shm folder.
        base = key.lstrip("/")
        if not base or "/" in base or base in (".", "..") or "\0" in base:
            raise InvalidArgumentError(f"shared memory region '{name}': key '{key}' is not a POSIX shared memory "
                                       f"name; expected '/name' with no further '/'")
        return self._dir / base

    # -- use by requests -------------------------------------------------------------------------------------

    def attach(self, request: InferRequest, skip: AbstractSet[str] = frozenset()) -> RegionLease | None:
        """Point the request's shared-memory inputs at their regions (zero-copy views) and hold every region
        it names until the returned lease is released. Regions named in ``skip`` (CUDA regions) are left alone.
        None when the request names no other region."""
        names = region_names(request) - skip
        if not names:
            return None
        held = self._table.acquire(names, lambda region: _check_alive(region, f"shared memory region '{region.name}'"))
        lease = RegionLease(self, held)
        try:
            for tensor in request.inputs:
                if tensor.member_regions:
                    lease.read_members(request, tensor)
                elif tensor.shared_memory is not None and tensor.shared_memory.region in names:
                    where = f"model '{request.model_name}': input '{tensor.name}'"
                    tensor.data = lease.read(tensor.shared_memory, tensor.datatype, tensor.shape, where)
            for output in request.outputs:
                refs = output.member_regions if output.shared_memory is None or \
                    output.shared_memory.region not in names else (output.shared_memory,)
                for ref in refs:
                    lease.window(ref, f"model '{request.model_name}': output '{output.name}'")
        except BaseException:
            lease.release()
            raise
        return lease


@dataclass(eq=False)
class RegionLease:
    """The regions one request uses, held until :meth:`release`."""

    registry: SharedMemoryRegistry
    regions: dict[str, _Region]
    released: bool = field(default=False)

    def window(self, ref: SharedMemoryRef, where: str) -> tuple[_Region, int]:
        """The region and the absolute start of ``ref`` in its mapping, after the bounds checks."""
        region = self.regions[ref.region]
        check_window(ref, region.status.byte_size, where)
        return region, region.status.offset + ref.offset

    def read(self, ref: SharedMemoryRef, datatype: DataType, shape: tuple[int, ...],
             where: str) -> npt.NDArray[Any]:
        """The input's data: a read-only view over the region (BYTES elements are parsed, so copied)."""
        region, start = self.window(ref, where)
        count = element_count(shape)
        if datatype is DataType.BYTES:
            with region.open_for(where) as memory:
                try:
                    return decode_bytes(memoryview(memory)[start:start + ref.byte_size], count).reshape(shape)
                except InvalidArgumentError as exc:
                    raise InvalidArgumentError(f"{where} (BYTES in shared memory region '{ref.region}'): "
                                               f"{exc.message}") from None
        needed = count * datatype.numpy_dtype.itemsize
        if ref.byte_size != needed:
            raise InvalidArgumentError(f"{where}: shared_memory_byte_size is {ref.byte_size} but shape "
                                       f"{list(shape)} of {datatype.wire_name} needs {needed} bytes")
        with region.open_for(where) as memory:
            view = np.frombuffer(memory, dtype=datatype.numpy_dtype, count=count, offset=start)
        view.flags.writeable = False
        return view.reshape(shape)

    def read_members(self, request: InferRequest, tensor: InputTensor) -> None:
        """A joined request's input (kiln.v2.joined): each member's rows read where they lie, into ``parts``;
        ``data`` stands for the joined shape only (zero strides, no bytes), which is what validation reads."""
        where = f"model '{request.model_name}': input '{tensor.name}'"
        row = tensor.shape[1:]
        tensor.parts = tuple(self.read(ref, tensor.datatype, (rows, *row), where)
                             for ref, rows in zip(tensor.member_regions, request.member_rows, strict=True))
        tensor.data = np.broadcast_to(np.zeros((), tensor.parts[0].dtype), tensor.shape)

    def finish(self, request: InferRequest, response: InferResponse) -> None:
        """Before :meth:`release`: write every output the request asked for in shared memory into its region (a
        joined request's: each member's rows into that member's; the response keeps only the parameters that say
        where the data went), and give every other output that
        views region memory (a model returning its input) its own copy, since the frontend serialises it after
        the regions may be unregistered, truncated or reused by the client."""
        wanted = {o.name: o.shared_memory for o in request.outputs
                  if o.shared_memory is not None and o.shared_memory.region in self.regions}
        members = {o.name: o.member_regions for o in request.outputs if o.member_regions}
        model = response.model_name
        outputs = []
        for output in response.outputs:
            if output.name in wanted:
                outputs.append(self._write(output, wanted[output.name], model))
            elif output.name in members:
                outputs.append(self._write_members(output, members[output.name], request.member_rows, model))
            else:
                outputs.append(self._own(output))
        response.outputs = outputs

    def _write_members(self, output: OutputTensor, refs: tuple[SharedMemoryRef, ...], rows: tuple[int, ...],
                       model: str) -> OutputTensor:
        """A joined request's output: each member's rows into its own region. The answer says where the first
        member's went; the frontend worker answers each member from what it asked."""
        if not output.shape or output.shape[0] != sum(rows):
            raise InvalidArgumentError(f"model '{model}': output '{output.name}' has shape {list(output.shape)}, "
                                       f"whose first dimension is not the {sum(rows)} rows of the members' requests")
        start = 0
        checked: set[str] = set()  # members often share a region: its object is looked at once
        for ref, count in zip(refs, rows, strict=True):
            self._write(replace(output, shape=(count, *output.shape[1:]), data=output.data[start:start + count]),
                        ref, model, checked)
            start += count
        return replace(output, data=output.data[:0], shared_memory=refs[0])

    def _own(self, output: OutputTensor) -> OutputTensor:
        for region in self.regions.values():
            with region.guard:
                if region.memory.closed:
                    continue  # really unmapped (close() found no view of it), so the output cannot be one
                # may_share_memory compares bounds only: a false positive costs a copy, never a wrong answer.
                if np.may_share_memory(output.data, np.frombuffer(region.memory, np.uint8)):
                    return replace(output, data=output.data.copy())
        return output

    def _write(self, output: OutputTensor, ref: SharedMemoryRef, model: str,
               checked: set[str] | None = None) -> OutputTensor:
        where = f"model '{model}': output '{output.name}'"
        region, start = self.window(ref, where)
        if output.datatype is DataType.BYTES:
            blob = memoryview(encode_bytes(output.data))
        else:
            array = np.ascontiguousarray(output.data, dtype=output.datatype.numpy_dtype).reshape(-1)
            blob = memoryview(array.view(np.uint8).data)
        if blob.nbytes > ref.byte_size:
            raise InvalidArgumentError(f"{where} has {blob.nbytes} bytes (shape {list(output.shape)}) but "
                                       f"shared_memory_byte_size in region '{ref.region}' is {ref.byte_size}")
        with region.guard:
            if checked is None or ref.region not in checked:
                _check_alive(region, f"{where} (shared memory region '{ref.region}')")
                if checked is not None:
                    checked.add(ref.region)
            else:
                _check_open(region, where)
            region.memory[start:start + blob.nbytes] = blob
        parameters = {**output.parameters, "shared_memory_region": ref.region,
                      "shared_memory_byte_size": blob.nbytes}
        if ref.offset:
            parameters["shared_memory_offset"] = ref.offset
        return replace(output, parameters=parameters, shared_memory=ref)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.registry._table.release(self.regions.values())


def region_names(request: InferRequest) -> set[str]:
    """Every shared-memory region a request's inputs and outputs name."""
    names = {t.shared_memory.region for t in request.inputs if t.shared_memory is not None}
    if request.outputs:
        names.update(o.shared_memory.region for o in request.outputs if o.shared_memory is not None)
    if request.member_rows:
        for tensor in request.inputs:
            names.update(ref.region for ref in tensor.member_regions)
        for output in request.outputs:
            names.update(ref.region for ref in output.member_regions)
    return names


def check_window(ref: SharedMemoryRef, region_size: int, where: str) -> None:
    """``ref``'s offset and size must lie inside a region of ``region_size`` bytes."""
    if ref.offset >= region_size:
        raise InvalidArgumentError(f"{where}: shared_memory_offset {ref.offset} is outside shared memory region "
                                   f"'{ref.region}' ({region_size} bytes)")
    if ref.offset + ref.byte_size > region_size:
        raise InvalidArgumentError(f"{where}: shared_memory_offset {ref.offset} + shared_memory_byte_size "
                                   f"{ref.byte_size} = {ref.offset + ref.byte_size} exceeds shared memory "
                                   f"region '{ref.region}' ({region_size} bytes)")


def _map(status: RegionStatus, path: Path) -> _Region:
    what = f"shared memory region '{status.name}'"
    try:
        # O_NOFOLLOW: a symbolic link in the shm folder would make the region a window onto any file we can write.
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidArgumentError(f"cannot register {what}: no shared memory object with key '{status.key}' "
                                   f"exists; create it first (e.g. tritonclient.utils.shared_memory."
                                   f"create_shared_memory_region)") from None
    except OSError as exc:
        reason = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise InvalidArgumentError(f"cannot register {what}: shared memory object '{status.key}' cannot be "
                                   f"opened for reading and writing: {reason}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgumentError(f"cannot register {what}: key '{status.key}' is not a shared memory object "
                                       f"(not a regular file)")
        end = status.offset + status.byte_size
        if end > info.st_size:
            raise InvalidArgumentError(f"cannot register {what}: offset {status.offset} + byte_size "
                                       f"{status.byte_size} = {end} exceeds the {info.st_size} bytes of shared "
                                       f"memory object '{status.key}'")
        memory = mmap.mmap(fd, end, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return _Region(status, path, fd, memory, (info.st_dev, info.st_ino), host_memory.share(memoryview(memory)))


def _check_open(region: _Region, where: str) -> None:
    if region.closed:
        raise UnavailableError(f"{where}: shared memory region '{region.status.name}' was unmapped while the "
                               f"request used it (server shutting down)")


def _check_alive(region: _Region, where: str) -> None:
    """The key must still name the object we mapped, at its full size: touching a truncated mapping kills the
    process with SIGBUS, and a destroyed object means the client can no longer see what we write. Best-effort:
    nothing stops the client from truncating the object right after this check."""
    _check_open(region, where)
    status = region.status
    try:
        current = os.lstat(region.path)  # lstat: a symbolic link put in the key's place is not the object
    except OSError:
        current = None
    if current is None or (current.st_dev, current.st_ino) != region.inode:
        raise NotFoundError(f"shared memory region '{status.name}': shared memory object '{status.key}' no longer "
                            f"exists (destroyed or replaced after registration?); unregister the region and "
                            f"register it again")
    if current.st_size < status.offset + status.byte_size:  # the object we mapped: lstat's size is fstat's
        raise NotFoundError(f"shared memory region '{status.name}': shared memory object '{status.key}' shrank "
                            f"below offset + byte_size = {status.offset + status.byte_size} bytes after "
                            f"registration; unregister the region and register it again")
