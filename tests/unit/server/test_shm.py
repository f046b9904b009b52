"""The system shared-memory registry: registration, bounds, vanished keys, busy unregister, zero-copy views; and
the Server facade reading inputs from and writing outputs to regions."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import pytest

from kiln.demo import build_demo_repository
from kiln.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
    UnsupportedError,
)
from kiln.server import InferRequest, InputTensor, RequestedOutput, Server, ServerOptions
from kiln.server.request import SharedMemoryRef, shared_memory_ref
from kiln.server.shm import RegionStatus, SharedMemoryRegistry
from kiln.tensor import DataType


def _object(folder: Path, key: str, size: int) -> Path:
    path = folder / key.lstrip("/")
    path.write_bytes(bytes(size))
    return path


def _request(inputs: list[InputTensor], outputs: list[RequestedOutput] | None = None) -> InferRequest:
    return InferRequest("simple", inputs, outputs=outputs or [])


def _shm_input(name: str, ref: SharedMemoryRef, shape: tuple[int, ...] = (1, 16)) -> InputTensor:
    return InputTensor(name, DataType.INT32, shape, np.empty(0, np.int32), shared_memory=ref)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[SharedMemoryRegistry]:
    registry = SharedMemoryRegistry(tmp_path, busy_timeout_s=0.2)
    yield registry
    registry.close()


# -- registration --------------------------------------------------------------------------------------------


def test_register_status_and_unregister(registry: SharedMemoryRegistry, tmp_path: Path) -> None:
    _object(tmp_path, "/obj", 256)
    registry.register("b", "/obj", 0, 128)
    registry.register("a", "/obj", 128, 128)
    assert registry.status() == [RegionStatus("a", "/obj", 128, 128), RegionStatus("b", "/obj", 0, 128)]
    assert registry.status("b") == [RegionStatus("b", "/obj", 0, 128)]
    registry.unregister("b")
    registry.unregister("b")  # unknown names are not an error, as in Triton
    assert [s.name for s in registry.status()] == ["a"]
    registry.unregister()
    assert registry.status() == []
    with pytest.raises(NotFoundError, match="'a'"):
        registry.status("a")


def test_duplicate_name_is_already_exists(registry: SharedMemoryRegistry, tmp_path: Path) -> None:
    _object(tmp_path, "obj", 64)
    registry.register("r", "obj", 0, 64)
    with pytest.raises(AlreadyExistsError, match="'r' is already registered"):
        registry.register("r", "obj", 0, 32)


def test_region_must_fit_the_object(registry: SharedMemoryRegistry, tmp_path: Path) -> None:
    _object(tmp_path, "obj", 64)
    with pytest.raises(InvalidArgumentError, match=r"region 'r'.*offset 32 \+ byte_size 64 = 96 exceeds the 64 "
                                                   r"bytes of shared memory object 'obj'"):
        registry.register("r", "obj", 32, 64)
    with pytest.raises(InvalidArgumentError, match="byte_size must be a positive integer"):
        registry.register("r", "obj", 0, 0)
    assert registry.status() == []


@pytest.mark.parametrize("key", ["", "/", "../etc/passwd", "/a/b", "..", "/."])
def test_keys_cannot_leave_the_shm_folder(registry: SharedMemoryRegistry, key: str) -> None:
    with pytest.raises(InvalidArgumentError, match="is not a POSIX shared memory name"):
        registry.register("r", key, 0, 8)


def test_missing_key_names_the_key(registry: SharedMemoryRegistry) -> None:
    with pytest.raises(InvalidArgumentError, match="no shared memory object with key '/nothing' exists"):
        registry.register("r", "/nothing", 0, 8)


def test_real_posix_shared_memory_object() -> None:
    block = shared_memory.SharedMemory(create=True, size=64)
    try:
        registry = SharedMemoryRegistry()
        registry.register("real", "/" + block.name, 0, 64)
        np.frombuffer(block.buf, np.int32)[:] = np.arange(16, dtype=np.int32)
        lease = registry.attach(_request([_shm_input("INPUT0", SharedMemoryRef("real", 64))]))
        assert lease is not None
        lease.release()
        registry.close()
    finally:
        block.close()
        block.unlink()


# -- use by requests -----------------------------------------------------------------------------------------


def test_inputs_are_read_only_zero_copy_views(registry: SharedMemoryRegistry, tmp_path: Path) -> None:
    path = _object(tmp_path, "obj", 256)
    registry.register("r", "obj", 64, 128)
    tensor = _shm_input("INPUT0", SharedMemoryRef("r", 64, offset=32))
    lease = registry.attach(_request([tensor]))
    assert lease is not None
    assert tensor.data.shape == (1, 16) and not tensor.data.flags.writeable
    with open(path, "r+b") as f:  # a change to the object shows through the view: no copy was made
        f.seek(64 + 32)
        f.write(np.arange(16, dtype=np.int32).tobytes())
    np.testing.assert_array_equal(tensor.data, np.arange(16, dtype=np.int32).reshape(1, 16))
    lease.release()


@pytest.mark.parametrize(("ref", "message"), [
    (SharedMemoryRef("r", 64, offset=128), r"shared_memory_offset 128 is outside shared memory region 'r' \(128"),
    (SharedMemoryRef("r", 64, offset=96), r"96 \+ shared_memory_byte_size 64 = 160 exceeds shared memory region "
                                          r"'r' \(128 bytes\)"),
    (SharedMemoryRef("r", 60), "shared_memory_byte_size is 60 but shape"),
])
def test_out_of_range_or_wrong_size_names_the_region(registry: SharedMemoryRegistry, tmp_path: Path,
                                                     ref: SharedMemoryRef, message: str) -> None:
    _object(tmp_path, "obj", 128)
    registry.register("r", "obj", 0, 128)
    with pytest.raises(InvalidArgumentError, match=message):
        registry.attach(_request([_shm_input("INPUT0", ref)]))
    registry.unregister("r")  # the failed request released the region


def test_unknown_region_in_a_request(registry: SharedMemoryRegistry) -> None:
    with pytest.raises(NotFoundError, match="Unable to find shared memory region: 'nope'"):
        registry.attach(_request([_shm_input("INPUT0", SharedMemoryRef("nope", 64))]))


def test_vanished_or_shrunk_key_gives_a_clear_error(registry: SharedMemoryRegistry, tmp_path: Path) -> None:
    path = _object(tmp_path, "obj", 64)
    registry.register("r", "obj", 0, 64)
    os.truncate(path, 16)
    with pytest.raises(NotFoundError, match="'obj' shrank below offset \\+ byte_size = 64"):
        registry.attach(_request([_shm_input("INPUT0", SharedMemoryRef("r", 64))]))
    path.unlink()
    with pytest.raises(NotFoundError, match="region 'r': shared memory object 'obj' no longer exists"):
        registry.attach(_request([_shm_input("INPUT0", SharedMemoryRef("r", 64))]))
    registry.unregister("r")


def test_unregister_of_a_busy_region_fails_after_the_timeout(registry: SharedMemoryRegistry,
                                                             tmp_path: Path) -> None:
    _object(tmp_path, "obj", 64)
    registry.register("r", "obj", 0, 64)
    lease = registry.attach(_request([_shm_input("INPUT0", SharedMemoryRef("r", 64))]))
    assert lease is not None
    with pytest.raises(UnavailableError, match=r"'r' \(1 request\(s\)\): still in use"):
        registry.unregister("r")
    assert registry.status("r")  # still registered and usable
    lease.release()
    registry.unregister("r")
    assert registry.status() == []


def test_unregister_waits_for_in_flight_requests(tmp_path: Path) -> None:
    registry = SharedMemoryRegistry(tmp_path, busy_timeout_s=10.0)
    _object(tmp_path, "obj", 64)
    registry.register("r", "obj", 0, 64)
    request = _request([_shm_input("INPUT0", SharedMemoryRef("r", 64))])
    lease = registry.attach(request)
    assert lease is not None
    done = threading.Event()
    worker = threading.Thread(target=lambda: (registry.unregister("r"), done.set()))
    worker.start()
    time.sleep(0.05)
    assert not done.is_set()
    with pytest.raises(UnavailableError, match="'r' is being unregistered"):
        registry.attach(_request([_shm_input("INPUT0", SharedMemoryRef("r", 64))]))
    lease.release()
    worker.join(5)
    assert done.is_set() and registry.status() == []
    del request  # the view over the unmapped region was still alive during unregister: no crash


def test_shared_memory_parameters() -> None:
    assert shared_memory_ref({}, "x") is None
    assert shared_memory_ref({"shared_memory_region": "r", "shared_memory_byte_size": 8}, "x") == \
        SharedMemoryRef("r", 8)
    with pytest.raises(InvalidArgumentError, match="must be given together"):
        shared_memory_ref({"shared_memory_region": "r"}, "input 'a'")
    with pytest.raises(InvalidArgumentError, match="shared_memory_offset must be a non-negative integer"):
        shared_memory_ref({"shared_memory_region": "r", "shared_memory_byte_size": 8, "shared_memory_offset": -1},
                          "x")


# -- through the Server facade -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    build_demo_repository(root)
    return root


def test_server_reads_inputs_from_and_writes_outputs_to_regions(repo: Path) -> None:
    block = shared_memory.SharedMemory(create=True, size=256)
    server = Server(ServerOptions(repositories=[repo], allow_client_shm=True))
    server.start()
    try:
        assert "system_shared_memory" in server.metadata()["extensions"]  # type: ignore[operator]
        server.register_system_shared_memory("io", "/" + block.name, 0, 256)
        data = np.frombuffer(block.buf, np.int32)
        data[:16], data[16:32] = np.arange(16), np.ones(16)
        request = _request(
            [_shm_input("INPUT0", SharedMemoryRef("io", 64)), _shm_input("INPUT1", SharedMemoryRef("io", 64, 64))],
            [RequestedOutput("OUTPUT0", shared_memory=SharedMemoryRef("io", 64, 128)), RequestedOutput("OUTPUT1")])
        response = server.infer_sync(request)
        np.testing.assert_array_equal(data[32:48], np.arange(16) + 1)
        out0 = next(o for o in response.outputs if o.name == "OUTPUT0")
        assert out0.shared_memory == SharedMemoryRef("io", 64, 128)
        assert out0.parameters == {"shared_memory_region": "io", "shared_memory_byte_size": 64,
                                   "shared_memory_offset": 128}
        out1 = next(o for o in response.outputs if o.name == "OUTPUT1")
        assert out1.shared_memory is None
        np.testing.assert_array_equal(out1.data.reshape(-1), np.arange(16) - 1)
        small = _request([_shm_input("INPUT0", SharedMemoryRef("io", 64)),
                          _shm_input("INPUT1", SharedMemoryRef("io", 64, 64))],
                         [RequestedOutput("OUTPUT0", shared_memory=SharedMemoryRef("io", 32, 128))])
        with pytest.raises(InvalidArgumentError, match="output 'OUTPUT0' has 64 bytes.*region 'io' is 32"):
            server.infer_sync(small)
        server.unregister_system_shared_memory()
        del data
    finally:
        server.close()
        block.close()
        block.unlink()


def test_disabled_server_refuses_shared_memory(repo: Path) -> None:
    server = Server(ServerOptions(repositories=[repo]))
    server.start()
    try:
        assert "system_shared_memory" not in server.metadata()["extensions"]  # type: ignore[operator]
        with pytest.raises(UnsupportedError, match="--allow-client-shm"):
            server.register_system_shared_memory("r", "/k", 0, 8)
        with pytest.raises(UnsupportedError, match="--allow-client-shm"):
            server.system_shared_memory_status()
        with pytest.raises(UnsupportedError, match="--allow-client-shm"):
            server.infer_sync(_request([_shm_input("INPUT0", SharedMemoryRef("r", 64))]))
    finally:
        server.close()
