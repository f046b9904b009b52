"""The system shared-memory registry: registration, bounds, vanished or replaced keys, symbolic links, busy and
concurrent unregisters, zero-copy views; and the Server facade reading inputs from and writing outputs to regions,
and copying outputs that view a region before releasing it."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
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
from kiln.server.shm import SHM_DIR, RegionStatus, SharedMemoryRegistry
from kiln.tensor import DataType
from kiln.testing.repo import write_model
from kiln.v2.types import InferResponse, OutputTensor, SharedMemoryRef, shared_memory_ref

_ECHO = """name: "echo"
backend: "identity"
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1, 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 1, 16 ] } ]
"""


def _object(folder: Path, key: str, size: int) -> Path:
    path = folder / key.lstrip("/")
    path.write_bytes(bytes(size))
    return path


def _request(inputs: list[InputTensor], outputs: list[RequestedOutput] | None = None) -> InferRequest:
    return InferRequest("simple", inputs, outputs=outputs or [])


def _shm_input(name: str, ref: SharedMemoryRef, shape: tuple[int, ...] = (1, 16)) -> InputTensor:
    return InputTensor(name, DataType.INT32, shape, np.empty(0, np.int32), shared_memory=ref)


def _wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline, "condition not reached within 5 s"
        time.sleep(0.001)


def _unregister_in_thread(registry: SharedMemoryRegistry, name: str,
                          errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            registry.unregister(name)
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)
    worker = threading.Thread(target=run)
    worker.start()
    return worker


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[SharedMemoryRegistry]:
    registry = SharedMemoryRegistry(tmp_path, busy_timeout_s=0.2)
    yield registry
    registry.close()


@pytest.fixture
def block() -> Iterator[shared_memory.SharedMemory]:
    """A real POSIX shared-memory object of 256 bytes, destroyed afterwards."""
    block = shared_memory.SharedMemory(create=True, size=256)
    yield block
    with contextlib.suppress(BufferError):  # a failed test's traceback may still hold views of block.buf
        block.close()
    block.unlink()


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


def test_real_posix_shared_memory_object(block: shared_memory.SharedMemory) -> None:
    registry = SharedMemoryRegistry()
    try:
        registry.register("real", "/" + block.name, 0, 64)
        np.frombuffer(block.buf, np.int32, 16)[:] = np.arange(16, dtype=np.int32)
        tensor = _shm_input("INPUT0", SharedMemoryRef("real", 64))
        lease = registry.attach(_request([tensor]))
        assert lease is not None
        np.testing.assert_array_equal(tensor.data, np.arange(16, dtype=np.int32).reshape(1, 16))
        lease.release()
    finally:
        registry.close()


def test_symbolic_link_keys_are_refused(tmp_path: Path) -> None:
    target = tmp_path / "not-shared-memory"
    target.write_bytes(bytes(64))
    link = SHM_DIR / f"kiln-test-{uuid.uuid4().hex}"
    link.symlink_to(target)
    registry = SharedMemoryRegistry()
    try:
        with pytest.raises(InvalidArgumentError, match=f"object '/{link.name}' cannot be opened for reading and "
                                                       f"writing: it is a symbolic link"):
            registry.register("r", "/" + link.name, 0, 64)
        assert registry.status() == []
    finally:
        registry.close()
        link.unlink()


def test_keys_must_be_regular_files(registry: SharedMemoryRegistry, tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(InvalidArgumentError, match="key 'fifo' is not a shared memory object"):
        registry.register("r", "fifo", 0, 8)
    assert registry.status() == []


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


def test_key_replaced_by_a_symbolic_link_to_the_object(registry: SharedMemoryRegistry, tmp_path: Path) -> None:
    path = _object(tmp_path, "obj", 64)
    registry.register("r", "obj", 0, 64)
    path.rename(tmp_path / "moved")
    path.symlink_to(tmp_path / "moved")  # following it would find the very object that was mapped
    with pytest.raises(NotFoundError, match="'obj' no longer exists \\(destroyed or replaced"):
        registry.attach(_request([_shm_input("INPUT0", SharedMemoryRef("r", 64))]))


def test_a_region_unmapped_under_a_request_is_a_kiln_error(registry: SharedMemoryRegistry, tmp_path: Path) -> None:
    _object(tmp_path, "obj", 128)
    registry.register("r", "obj", 0, 128)
    request = _request([], [RequestedOutput("OUTPUT0", shared_memory=SharedMemoryRef("r", 64))])
    lease = registry.attach(request)
    assert lease is not None
    registry.close()  # server shutdown while the request still runs
    output = OutputTensor("OUTPUT0", DataType.INT32, (1, 16), np.arange(16, dtype=np.int32).reshape(1, 16))
    with pytest.raises(UnavailableError, match="output 'OUTPUT0' \\(shared memory region 'r'\\): shared memory "
                                               "region 'r' was unmapped while the request used it"):
        lease.finish(request, InferResponse("simple", "1", [output]))
    with pytest.raises(UnavailableError, match="input 'INPUT0': shared memory region 'r' was unmapped"):
        lease.read(SharedMemoryRef("r", 64), DataType.INT32, (1, 16), "model 'simple': input 'INPUT0'")
    lease.release()


def test_finish_copies_only_outputs_that_view_a_region(registry: SharedMemoryRegistry, tmp_path: Path) -> None:
    _object(tmp_path, "obj", 64)
    registry.register("r", "obj", 0, 64)
    tensor = _shm_input("INPUT0", SharedMemoryRef("r", 64))
    request = _request([tensor])
    lease = registry.attach(request)
    assert lease is not None
    echoed = OutputTensor("OUTPUT0", DataType.INT32, (1, 16), tensor.data[:, ::-1])
    own = OutputTensor("OUTPUT1", DataType.INT32, (1, 16), np.ones((1, 16), np.int32))
    response = InferResponse("simple", "1", [echoed, own])
    lease.finish(request, response)
    lease.release()
    assert not np.may_share_memory(response.outputs[0].data, tensor.data)
    np.testing.assert_array_equal(response.outputs[0].data, tensor.data[:, ::-1])
    assert response.outputs[1] is own


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
    registry = SharedMemoryRegistry(tmp_path, busy_timeout_s=30.0)
    path = _object(tmp_path, "obj", 64)
    registry.register("r", "obj", 0, 64)
    region = registry._table.listed("r")[0]
    tensor = _shm_input("INPUT0", SharedMemoryRef("r", 64))
    lease = registry.attach(_request([tensor]))
    assert lease is not None
    errors: list[BaseException] = []
    worker = _unregister_in_thread(registry, "r", errors)
    _wait_until(lambda: region.unregistering == 1)
    assert worker.is_alive()  # waiting for the lease: it can only leave after the 30 s timeout or a release
    with pytest.raises(UnavailableError, match="'r' is being unregistered"):
        registry.attach(_request([_shm_input("INPUT0", SharedMemoryRef("r", 64))]))
    assert registry.status("r")  # still registered while it waits
    lease.release()
    worker.join(5)
    assert not worker.is_alive() and errors == []
    assert registry.status() == [] and region.closed
    path.write_bytes(np.arange(16, dtype=np.int32).tobytes())  # the input's view outlived the unregister ...
    np.testing.assert_array_equal(tensor.data, np.arange(16, dtype=np.int32).reshape(1, 16))  # ... and still works


def test_concurrent_unregisters_of_a_busy_region(tmp_path: Path) -> None:
    registry = SharedMemoryRegistry(tmp_path, busy_timeout_s=30.0)
    _object(tmp_path, "obj", 64)
    registry.register("r", "obj", 0, 64)
    region = registry._table.listed("r")[0]
    lease = registry.attach(_request([_shm_input("INPUT0", SharedMemoryRef("r", 64))]))
    assert lease is not None
    errors: list[BaseException] = []
    workers = [_unregister_in_thread(registry, "r", errors) for _ in range(2)]
    _wait_until(lambda: region.unregistering == 2)  # both wait for the same lease
    lease.release()
    for worker in workers:
        worker.join(5)
    assert not any(worker.is_alive() for worker in workers)
    assert errors == []  # the second one finds the region gone: no KeyError
    assert registry.status() == [] and region.closed
    region.close()  # closing twice is a no-op: it must not close a descriptor number reused since
    registry.register("r", "obj", 0, 64)  # the name is free again and the new region works
    lease = registry.attach(_request([_shm_input("INPUT0", SharedMemoryRef("r", 64))]))
    assert lease is not None
    lease.release()
    registry.close()


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
    write_model(root, "echo", config=_ECHO)
    return root


def test_server_reads_inputs_from_and_writes_outputs_to_regions(repo: Path,
                                                                block: shared_memory.SharedMemory) -> None:
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


def test_an_output_that_views_an_input_region_is_copied(repo: Path, block: shared_memory.SharedMemory) -> None:
    server = Server(ServerOptions(repositories=[repo], allow_client_shm=True))
    server.start()
    try:
        server.register_system_shared_memory("in", "/" + block.name, 0, 64)
        np.frombuffer(block.buf, np.int32, 16)[:] = np.arange(16, dtype=np.int32)
        request = InferRequest("echo", [_shm_input("INPUT0", SharedMemoryRef("in", 64))])
        response = server.infer_sync(request)  # the identity backend returns its input array itself
        server.unregister_system_shared_memory("in")
        np.frombuffer(block.buf, np.int32, 16)[:] = -1  # the client reuses its region for the next request
        (output,) = response.outputs
        np.testing.assert_array_equal(output.data, np.arange(16, dtype=np.int32).reshape(1, 16))
    finally:
        server.close()


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
