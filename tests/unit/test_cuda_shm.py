"""CUDA shared memory without a GPU: the registry and the Server facade over host memory standing in for the
device (the registry only ever sees torch tensors, so the checks, the views and the busy logic are the same), and
a server on a host without CUDA answering status and unregister calls and refusing only registration. The real
device path runs in tests/integration/test_cuda_shm_gpu.py."""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kiln.demo import build_demo_repository  # noqa: E402
from kiln.errors import (  # noqa: E402
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
    UnsupportedError,
)
from kiln.server import InferRequest, InputTensor, RequestedOutput, Server, ServerOptions  # noqa: E402
from kiln.server.cuda_ipc import IPC_HANDLE_BYTES, unavailable_reason  # noqa: E402
from kiln.server.cuda_shm import CudaRegionStatus, CudaSharedMemoryRegistry, host_array  # noqa: E402
from kiln.tensor import DataType  # noqa: E402
from kiln.testing.repo import write_model  # noqa: E402
from kiln.v2.types import SharedMemoryRef  # noqa: E402

_DOUBLE = """name: "double"
platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""
_DOUBLE_BATCHED = _DOUBLE.replace('name: "double"', 'name: "double_batched"') + """
dynamic_batching { max_queue_delay_microseconds: 50000 }
"""


class HostRegionMemory:
    """Client "allocations" in host memory, found by handle: what CudaIpcMemory does with device memory."""

    def __init__(self) -> None:
        self.allocations: dict[bytes, Any] = {}
        self.closed: list[Any] = []

    def unavailable_reason(self) -> str | None:
        return None

    def allocate(self, size: int) -> tuple[bytes, Any]:
        handle = len(self.allocations).to_bytes(2, "little") * (IPC_HANDLE_BYTES // 2)
        self.allocations[handle] = torch.zeros(size, dtype=torch.uint8)
        return handle, self.allocations[handle]

    def open(self, handle: bytes, device_id: int, byte_size: int, where: str) -> Any:
        allocation = self.allocations.get(handle)
        if allocation is None:
            raise InvalidArgumentError(f"{where}: cannot open the CUDA IPC handle on device {device_id}")
        if byte_size > allocation.numel():
            raise InvalidArgumentError(f"{where}: byte_size {byte_size} exceeds the {allocation.numel()} bytes")
        return allocation[:byte_size]

    def close(self, memory: Any) -> None:
        self.closed.append(memory)


def _view(allocation: Any, dtype: Any) -> np.ndarray:
    return np.asarray(allocation.numpy()).view(dtype)


@pytest.fixture
def memory() -> HostRegionMemory:
    return HostRegionMemory()


@pytest.fixture
def registry(memory: HostRegionMemory) -> Iterator[CudaSharedMemoryRegistry]:
    registry = CudaSharedMemoryRegistry(memory, busy_timeout_s=0.2)
    yield registry
    registry.close()


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    build_demo_repository(root)
    source = root / "double.pt"
    with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript, which the backend still serves
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=DeprecationWarning)
        torch.jit.script(_Double()).save(str(source))
    for name, config in (("double", _DOUBLE), ("double_batched", _DOUBLE_BATCHED)):
        folder = write_model(root, name, config=config)
        (folder / "1").mkdir(exist_ok=True)
        (folder / "1" / "model.pt").write_bytes(source.read_bytes())
    source.unlink()
    return root


class _Double(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


@pytest.fixture
def server(repo: Path, memory: HostRegionMemory) -> Iterator[Server]:
    server = Server(ServerOptions(repositories=[repo], allow_client_shm=True))
    server.start()
    server._regions.cuda = CudaSharedMemoryRegistry(memory, busy_timeout_s=0.2)  # host memory for the device
    yield server
    server.close()


def _input(name: str, ref: SharedMemoryRef, datatype: DataType = DataType.INT32,
           shape: tuple[int, ...] = (1, 16)) -> InputTensor:
    return InputTensor(name, datatype, shape, np.empty(0, datatype.numpy_dtype), shared_memory=ref)


def _simple(region: str, out_offset: int = 128, out_size: int = 64) -> InferRequest:
    return InferRequest("simple", [_input("INPUT0", SharedMemoryRef(region, 64)),
                                   _input("INPUT1", SharedMemoryRef(region, 64, 64))],
                        outputs=[RequestedOutput("OUTPUT0", shared_memory=SharedMemoryRef(region, out_size,
                                                                                          out_offset)),
                                 RequestedOutput("OUTPUT1")])


# -- registration --------------------------------------------------------------------------------------------


def test_register_status_and_unregister(registry: CudaSharedMemoryRegistry, memory: HostRegionMemory) -> None:
    handle, _ = memory.allocate(256)
    registry.register("a", handle, 0, 256)
    assert registry.status() == [CudaRegionStatus("a", 0, 256)]
    assert registry.status("a") == [CudaRegionStatus("a", 0, 256)]
    with pytest.raises(NotFoundError, match="Unable to find cuda shared memory region: 'b'"):
        registry.status("b")
    with pytest.raises(AlreadyExistsError, match="'a' is already registered"):
        registry.register("a", handle, 0, 256)
    registry.unregister("b")  # unknown: not an error, as in Triton
    registry.unregister("a")
    assert registry.status() == [] and len(memory.closed) == 1


@pytest.mark.parametrize(("device_id", "byte_size", "message"), [
    (-1, 8, "device_id must be a non-negative integer, got -1"),
    (0, 0, "byte_size must be a positive integer, got 0"),
    (0, 512, "byte_size 512 exceeds the 256 bytes"),
])
def test_bad_registrations_name_the_region(registry: CudaSharedMemoryRegistry, memory: HostRegionMemory,
                                           device_id: int, byte_size: int, message: str) -> None:
    handle, _ = memory.allocate(256)
    with pytest.raises(InvalidArgumentError, match=message):
        registry.register("r", handle, device_id, byte_size)
    assert registry.status() == []


def test_unknown_handle_is_refused(registry: CudaSharedMemoryRegistry) -> None:
    with pytest.raises(InvalidArgumentError, match="cannot register CUDA shared memory region 'r': cannot open"):
        registry.register("r", b"\x07" * IPC_HANDLE_BYTES, 0, 8)


# -- requests through the Server -----------------------------------------------------------------------------


def test_host_engine_gets_copies_and_outputs_land_in_the_region(server: Server, memory: HostRegionMemory) -> None:
    handle, allocation = memory.allocate(256)
    server.register_cuda_shared_memory("io", handle, 0, 256)
    ints = _view(allocation, np.int32)
    ints[:16], ints[16:32] = np.arange(16), np.ones(16)
    response = server.infer_sync(_simple("io"))
    np.testing.assert_array_equal(ints[32:48], np.arange(16) + 1)
    out0, out1 = sorted(response.outputs, key=lambda o: o.name)
    assert out0.parameters == {"shared_memory_region": "io", "shared_memory_byte_size": 64,
                               "shared_memory_offset": 128}
    assert out0.data.size == 0  # the data went to the region
    assert isinstance(out1.data, np.ndarray)
    np.testing.assert_array_equal(out1.data.reshape(-1), np.arange(16) - 1)


def test_torch_engine_reads_inputs_in_place(server: Server, memory: HostRegionMemory) -> None:
    handle, allocation = memory.allocate(64)
    server.register_cuda_shared_memory("t", handle, 0, 64)
    floats = _view(allocation, np.float32)
    floats[:8] = np.arange(8, dtype=np.float32)
    request = InferRequest("double", [_input("INPUT__0", SharedMemoryRef("t", 32), DataType.FP32, (2, 4))],
                           outputs=[RequestedOutput("OUTPUT__0", shared_memory=SharedMemoryRef("t", 32, 32))])
    seen: list[Any] = []
    original = server._regions.cuda.attach

    def spy(*args: Any) -> Any:
        lease = original(*args)
        seen.append(args[0].inputs[0].data)
        return lease

    server._regions.cuda.attach = spy  # type: ignore[method-assign]
    server.infer_sync(request)
    assert isinstance(seen[0], torch.Tensor) and seen[0].data_ptr() == allocation.data_ptr()  # a view, no copy
    np.testing.assert_array_equal(floats[8:16], np.arange(8, dtype=np.float32) * 2)


@pytest.mark.parametrize(("ref", "message"), [
    (SharedMemoryRef("io", 64, 256), "shared_memory_offset 256 is outside shared memory region 'io' \\(256 bytes\\)"),
    (SharedMemoryRef("io", 64, 224),
     "shared_memory_offset 224 \\+ shared_memory_byte_size 64 = 288 exceeds shared memory region 'io'"),
    (SharedMemoryRef("io", 60), "shared_memory_byte_size is 60 but shape \\[1, 16\\] of INT32 needs 64 bytes"),
])
def test_bad_offsets_and_sizes_name_model_tensor_and_region(server: Server, memory: HostRegionMemory,
                                                            ref: SharedMemoryRef, message: str) -> None:
    handle, _ = memory.allocate(256)
    server.register_cuda_shared_memory("io", handle, 0, 256)
    request = InferRequest("simple", [_input("INPUT0", ref), _input("INPUT1", SharedMemoryRef("io", 64, 64))])
    with pytest.raises(InvalidArgumentError, match=f"model 'simple': input 'INPUT0': {message}"):
        server.infer_sync(request)
    with pytest.raises(InvalidArgumentError, match="output 'OUTPUT0' has 64 bytes .* in CUDA region 'io' is 32"):
        server.infer_sync(_simple("io", out_size=32))
    server.unregister_cuda_shared_memory("io")  # nothing was left holding the region


def test_misaligned_device_view_is_refused(server: Server, memory: HostRegionMemory) -> None:
    handle, _ = memory.allocate(64)
    server.register_cuda_shared_memory("t", handle, 0, 64)
    request = InferRequest("double", [_input("INPUT__0", SharedMemoryRef("t", 16, 2), DataType.FP32, (1, 4))])
    with pytest.raises(InvalidArgumentError, match="shared_memory_offset 2 .* not a multiple of the 4-byte size"):
        server.infer_sync(request)


def test_names_are_one_namespace_and_unknown_regions_are_not_found(server: Server,
                                                                   memory: HostRegionMemory) -> None:
    handle, _ = memory.allocate(64)
    server.register_cuda_shared_memory("r", handle, 0, 64)
    with pytest.raises(AlreadyExistsError, match="'r' is already registered \\(as CUDA shared memory\\)"):
        server.register_system_shared_memory("r", "/kiln-never-opened", 0, 64)
    with pytest.raises(NotFoundError, match="Unable to find shared memory region: 'nope'"):
        server.infer_sync(_simple("nope"))
    assert server.cuda_shared_memory_status("r") == [CudaRegionStatus("r", 0, 64)]


def test_many_requests_share_one_region(server: Server, memory: HostRegionMemory) -> None:
    """Each request reads its own window and writes its own output window of one region, all at once."""
    count = 32
    handle, allocation = memory.allocate(count * 192)
    server.register_cuda_shared_memory("shared", handle, 0, count * 192)
    ints = _view(allocation, np.int32)
    for i in range(count):
        ints[i * 48:i * 48 + 16] = np.arange(16) + i
        ints[i * 48 + 16:i * 48 + 32] = i

    def run(i: int) -> None:
        base = i * 192
        request = InferRequest("simple", [_input("INPUT0", SharedMemoryRef("shared", 64, base)),
                                          _input("INPUT1", SharedMemoryRef("shared", 64, base + 64))],
                               outputs=[RequestedOutput("OUTPUT0",
                                                        shared_memory=SharedMemoryRef("shared", 64, base + 128))])
        server.infer_sync(request)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(run, range(count)))
    for i in range(count):
        np.testing.assert_array_equal(ints[i * 48 + 32:i * 48 + 48], np.arange(16) + 2 * i)
    assert server._regions.cuda._table.listed("shared")[0].inflight == 0


def test_unregister_waits_for_a_busy_region_then_fails(registry: CudaSharedMemoryRegistry,
                                                       memory: HostRegionMemory) -> None:
    handle, _ = memory.allocate(128)
    registry.register("busy", handle, 0, 128)
    request = InferRequest("m", [_input("INPUT0", SharedMemoryRef("busy", 64))])
    lease = registry.attach(request, {"busy"}, on_device=False)
    with pytest.raises(UnavailableError, match="'busy' \\(1 request\\(s\\)\\): still in use"):
        registry.unregister("busy")
    with pytest.raises(UnavailableError, match="'busy' is being unregistered"):
        waiting = threading.Thread(target=_unregister_patiently, args=(registry,))
        waiting.start()
        time.sleep(0.05)
        registry.attach(request, {"busy"}, on_device=False)  # refused while an unregister waits
    lease.release()
    waiting.join()
    assert registry.status() == []


def _unregister_patiently(registry: CudaSharedMemoryRegistry) -> None:
    registry._table.busy_timeout_s = 5.0  # this unregister waits for the lease the test holds
    registry.unregister("busy")


def test_host_array_keeps_the_bits() -> None:
    bf16 = torch.tensor([[1.5, -2.25]], dtype=torch.bfloat16)
    array = host_array(bf16, DataType.BF16)
    assert array.dtype == DataType.BF16.numpy_dtype and array.shape == (1, 2)
    np.testing.assert_array_equal(array.astype(np.float32), [[1.5, -2.25]])
    plain = np.arange(3)
    assert host_array(plain, DataType.INT64) is plain


# -- a host without CUDA ---------------------------------------------------------------------------------------


class NoDeviceMemory(HostRegionMemory):
    """A host whose CUDA regions cannot be opened, whatever this test host has."""

    def unavailable_reason(self) -> str | None:
        return "PyTorch sees no CUDA device on this host"


@pytest.fixture
def server_without_cuda(repo: Path) -> Iterator[Server]:
    server = Server(ServerOptions(repositories=[repo], allow_client_shm=True))
    server.start()
    server._regions.cuda = CudaSharedMemoryRegistry(NoDeviceMemory())
    yield server
    server.close()


def test_server_without_cuda_answers_status_and_unregister(server_without_cuda: Server) -> None:
    """What the official client examples do first (unregister every region), and status, answer as in Triton;
    only registering says why it cannot be done."""
    server = server_without_cuda
    server.unregister_cuda_shared_memory()
    server.unregister_cuda_shared_memory("never_registered")
    assert server.cuda_shared_memory_status() == []
    with pytest.raises(NotFoundError, match="Unable to find cuda shared memory region: 'never_registered'"):
        server.cuda_shared_memory_status("never_registered")
    message = "CUDA shared memory is not supported on this server: PyTorch sees no CUDA device on this host"
    for call in (lambda: server.register_cuda_shared_memory("r", bytes(IPC_HANDLE_BYTES), 0, 8),
                 server.check_cuda_shm):
        with pytest.raises(UnsupportedError, match=message):
            call()
    assert server.cuda_shared_memory_status() == []
    extensions = server.metadata()["extensions"]
    assert "system_shared_memory" in extensions and "cuda_shared_memory" not in extensions  # type: ignore[operator]


def test_status_and_unregister_of_the_other_kind(server: Server, memory: HostRegionMemory) -> None:
    """One namespace: a status call of one kind for a region of the other says which kind holds it (Triton's
    answer), and an unregister call of the wrong kind leaves the region alone."""
    handle, _ = memory.allocate(64)
    server.register_cuda_shared_memory("gpu", handle, 0, 64)
    block = shared_memory.SharedMemory(create=True, size=64)
    try:
        server.register_system_shared_memory("host", f"/{block.name}", 0, 64)
        with pytest.raises(NotFoundError, match="'host' is registered as system shared memory, not CUDA shared"):
            server.cuda_shared_memory_status("host")
        with pytest.raises(NotFoundError, match="'gpu' is registered as CUDA shared memory, not system shared"):
            server.system_shared_memory_status("gpu")
        server.unregister_cuda_shared_memory("host")
        server.unregister_system_shared_memory("gpu")
        assert [r.name for r in server.system_shared_memory_status()] == ["host"]
        assert [r.name for r in server.cuda_shared_memory_status()] == ["gpu"]
        server.unregister_cuda_shared_memory()
        assert server.cuda_shared_memory_status() == [] and len(memory.closed) == 1
        assert [r.name for r in server.system_shared_memory_status()] == ["host"]
    finally:
        server.unregister_system_shared_memory()
        block.close()
        block.unlink()


@pytest.mark.skipif(unavailable_reason() is None, reason="this host can serve CUDA shared memory")
def test_this_host_without_cuda_says_why(repo: Path) -> None:
    """The real CUDA IPC opener on a host that cannot use it."""
    server = Server(ServerOptions(repositories=[repo], allow_client_shm=True))
    server.start()
    try:
        extensions = server.metadata()["extensions"]
        assert "system_shared_memory" in extensions and "cuda_shared_memory" not in extensions  # type: ignore[operator]
        with pytest.raises(UnsupportedError, match="CUDA shared memory is not supported on this server: "):
            server.register_cuda_shared_memory("r", bytes(IPC_HANDLE_BYTES), 0, 8)
        server.unregister_cuda_shared_memory()
        assert server.cuda_shared_memory_status() == []
    finally:
        server.close()


def test_disabled_server_refuses_cuda_shared_memory(repo: Path) -> None:
    server = Server(ServerOptions(repositories=[repo]))
    server.start()
    try:
        assert "cuda_shared_memory" not in server.metadata()["extensions"]  # type: ignore[operator]
        for call in (lambda: server.register_cuda_shared_memory("r", bytes(64), 0, 8),
                     server.cuda_shared_memory_status, server.unregister_cuda_shared_memory):
            with pytest.raises(UnsupportedError, match="CUDA shared memory is disabled.*--allow-client-shm"):
                call()
    finally:
        server.close()


async def test_region_and_body_inputs_batch_together(server: Server, memory: HostRegionMemory) -> None:
    """Requests whose input lies in a CUDA region (a tensor) and requests with the input in the body (numpy) share
    one dynamic batch; each gets its own rows back, in its region or in its response."""
    handle, allocation = memory.allocate(2 * 64)
    server.register_cuda_shared_memory("b", handle, 0, 2 * 64)
    floats = _view(allocation, np.float32)
    for i in range(2):
        floats[i * 16:i * 16 + 8] = np.arange(8, dtype=np.float32) + 10 * i

    def from_region(i: int) -> InferRequest:
        return InferRequest("double_batched", [_input("INPUT__0", SharedMemoryRef("b", 32, i * 64), DataType.FP32,
                                                      (2, 4))],
                            outputs=[RequestedOutput("OUTPUT__0", shared_memory=SharedMemoryRef("b", 32, i * 64 + 32))])

    def from_body(i: int) -> InferRequest:
        data = np.full((1, 4), -float(i), np.float32)
        return InferRequest("double_batched", [InputTensor("INPUT__0", DataType.FP32, data.shape, data)])

    answers = await asyncio.gather(*(server.infer(from_region(i)) for i in range(2)),
                                   *(server.infer(from_body(i)) for i in range(1, 4)))
    for i in range(2):
        np.testing.assert_array_equal(floats[i * 16 + 8:i * 16 + 16], (np.arange(8, dtype=np.float32) + 10 * i) * 2)
    for i, answer in zip(range(1, 4), answers[2:], strict=True):
        np.testing.assert_array_equal(answer.outputs[0].data, np.full((1, 4), -2.0 * i, np.float32))
    stats = server.model_statistics("double_batched")[0]
    assert max(stats.batch_stats) == 7  # 2 requests of 2 rows and 3 of 1, in one batch
