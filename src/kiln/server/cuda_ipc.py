"""Open a client's CUDA IPC memory handle as device memory the server can use, through whatever the GPU host has.

A CUDA shared-memory region is device memory that a client allocated (``cudaMalloc``) and exported with
``cudaIpcGetMemHandle``; the 64-byte handle travels in the register request. The server opens it with
``cudaIpcOpenMemHandle`` through cuda-python (``cuda.bindings``, which ``tritonclient.utils.cuda_shared_memory``
also needs) or cupy, imported only when a region is registered, and wraps the pointer as a 1-D ``torch.uint8``
CUDA tensor (through ``__cuda_array_interface__``, no copy) so that request inputs can be torch views of it.

Nothing here is imported unless CUDA shared memory is used: a server without a GPU never imports torch for it.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
from typing import Any, Protocol

from kiln.errors import InvalidArgumentError

IPC_HANDLE_BYTES = 64
"""``CUDA_IPC_HANDLE_SIZE``: the size of a ``cudaIpcMemHandle_t``."""


class RegionMemory(Protocol):
    """Opens and closes the memory of CUDA regions; the registry only ever sees torch tensors."""

    def unavailable_reason(self) -> str | None:
        """Why no region can be opened on this host, or None when regions can be opened."""

    def open(self, handle: bytes, device_id: int, byte_size: int, where: str) -> Any:
        """A 1-D ``torch.uint8`` tensor of ``byte_size`` bytes over the memory ``handle`` names."""

    def close(self, memory: Any) -> None:
        """Let go of memory :meth:`open` returned (its tensor views must no longer be used)."""


class _DeviceBuffer:
    """``__cuda_array_interface__`` over raw device memory, so ``torch.as_tensor`` wraps it without a copy."""

    def __init__(self, pointer: int, byte_size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (byte_size,), "typestr": "|u1", "data": (pointer, False),
                                         "strides": None, "version": 3}


@functools.cache
def _opener_module() -> str | None:
    for module in ("cuda.bindings.runtime", "cupy"):
        try:
            if importlib.util.find_spec(module) is not None:
                return module
        except ModuleNotFoundError:  # the parent package ('cuda') is missing
            continue
    return None


@functools.cache
def unavailable_reason() -> str | None:
    """Why this host cannot serve CUDA shared memory, or None when it can (cached: the answer does not change)."""
    module = _opener_module()
    if module is None:
        return "neither cuda-python (cuda.bindings) nor cupy is installed, so CUDA IPC handles cannot be opened"
    if importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed (kiln hands CUDA shared-memory tensors to engines as torch tensors)"
    import torch

    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device on this host"
    return None


class CudaIpcMemory:
    """The real :class:`RegionMemory`: CUDA IPC through cuda-python, else cupy. It can be made on any host, so that
    a server without CUDA still answers status and unregister calls; :meth:`open` needs a host that can serve CUDA
    shared memory (the registry checks :meth:`unavailable_reason` first)."""

    def __init__(self) -> None:
        self._pointers: dict[int, tuple[int, int]] = {}  # id(tensor) -> (device pointer, device id)

    def unavailable_reason(self) -> str | None:
        return unavailable_reason()

    def open(self, handle: bytes, device_id: int, byte_size: int, where: str) -> Any:
        import torch

        if len(handle) != IPC_HANDLE_BYTES:
            raise InvalidArgumentError(f"{where}: raw_handle has {len(handle)} bytes; a CUDA IPC memory handle "
                                       f"(cudaIpcMemHandle_t) has {IPC_HANDLE_BYTES}")
        if not 0 <= device_id < torch.cuda.device_count():
            raise InvalidArgumentError(f"{where}: device_id {device_id} is not a CUDA device of this server "
                                       f"(it has {torch.cuda.device_count()})")
        torch.zeros(1, device=f"cuda:{device_id}")  # torch's (primary) context exists: the handle opens in it
        with torch.cuda.device(device_id):
            opened = _open_cuda_python if _opener_module() == "cuda.bindings.runtime" else _open_cupy
            pointer, allocation = opened(handle, device_id, where)
            try:
                if allocation is not None and byte_size > allocation:
                    raise InvalidArgumentError(f"{where}: byte_size {byte_size} exceeds the {allocation} bytes of "
                                               f"the device allocation the handle names")
                memory = torch.as_tensor(_DeviceBuffer(pointer, byte_size), device=f"cuda:{device_id}")
            except BaseException:
                self._close_pointer(pointer, device_id)
                raise
        self._pointers[id(memory)] = (pointer, device_id)
        return memory

    def close(self, memory: Any) -> None:
        found = self._pointers.pop(id(memory), None)
        if found is not None:
            self._close_pointer(*found)

    def _close_pointer(self, pointer: int, device_id: int) -> None:
        import torch

        with torch.cuda.device(device_id):
            torch.cuda.synchronize()  # no kernel may still read or write the memory
            if _opener_module() == "cuda.bindings.runtime":
                _module("cuda.bindings.runtime").cudaIpcCloseMemHandle(pointer)
            else:
                _module("cupy").cuda.runtime.ipcCloseMemHandle(pointer)


def _open_cuda_python(handle: bytes, device_id: int, where: str) -> tuple[int, int | None]:
    runtime, driver = _module("cuda.bindings.runtime"), _module("cuda.bindings.driver")
    ipc_handle = runtime.cudaIpcMemHandle_t()
    # cuda-bindings 13 exposes the handle's bytes only through its address (as tritonclient reads them).
    ctypes.memmove(ipc_handle.getPtr(), handle, IPC_HANDLE_BYTES)
    error, pointer = runtime.cudaIpcOpenMemHandle(ipc_handle, runtime.cudaIpcMemLazyEnablePeerAccess)
    if error != runtime.cudaError_t.cudaSuccess:
        raise InvalidArgumentError(f"{where}: cannot open the CUDA IPC handle on device {device_id}: "
                                   f"{_error_name(runtime.cudaGetErrorString(error))} (a handle must come from "
                                   f"cudaIpcGetMemHandle in another process on this host)")
    pointer = int(pointer)
    result, _, size = driver.cuMemGetAddressRange(pointer)
    return pointer, int(size) if result == driver.CUresult.CUDA_SUCCESS else None


def _open_cupy(handle: bytes, device_id: int, where: str) -> tuple[int, int | None]:
    cupy = _module("cupy")
    try:
        pointer = cupy.cuda.runtime.ipcOpenMemHandle(handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise InvalidArgumentError(f"{where}: cannot open the CUDA IPC handle on device {device_id}: {exc} (a "
                                   f"handle must come from cudaIpcGetMemHandle in another process on this "
                                   f"host)") from None
    return int(pointer), None


def _module(name: str) -> Any:
    """An optional GPU library, imported when first needed (typed Any: none of them ship type information)."""
    return importlib.import_module(name)


def _error_name(answer: Any) -> str:
    _, text = answer
    return text.decode() if isinstance(text, bytes) else str(text)
