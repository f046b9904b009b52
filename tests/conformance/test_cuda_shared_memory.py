"""CUDA shared-memory status and unregister calls with the real tritonclient (HTTP and gRPC) against `kiln serve
--allow-client-shm`: the official shared-memory examples unregister every CUDA region before they start, which must
succeed on any host, as in Triton, also one without CUDA, where only registering a CUDA region is refused."""

from __future__ import annotations

import base64
import uuid
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from kiln.server.cuda_ipc import IPC_HANDLE_BYTES, unavailable_reason
from kiln.testing.serve import KilnProcess

pytestmark = pytest.mark.conformance

TENSOR_BYTES = 16 * 4  # simple: INT32 [1, 16]


def _client(protocol: str, server: KilnProcess) -> Any:
    if protocol == "http":
        return httpclient.InferenceServerClient(server.http_url)
    return grpcclient.InferenceServerClient(server.grpc_url)


def _cuda_regions(client: Any, name: str = "") -> list[str]:
    """The names of the CUDA regions the server lists, from either client's answer."""
    if isinstance(client, httpclient.InferenceServerClient):
        return [r["name"] for r in client.get_cuda_shared_memory_status(name)]
    return sorted(client.get_cuda_shared_memory_status(name, as_json=True).get("regions", {}))


def _system_regions(client: Any) -> list[str]:
    if isinstance(client, httpclient.InferenceServerClient):
        return [r["name"] for r in client.get_system_shared_memory_status()]
    return sorted(client.get_system_shared_memory_status(as_json=True).get("regions", {}))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_official_example_flow_starts_by_unregistering_everything(shm_server: KilnProcess,
                                                                      protocol: str) -> None:
    """As simple_{http,grpc}_shm_client.py: unregister every system and CUDA region, then infer with system regions."""
    module: Any = httpclient if protocol == "http" else grpcclient
    client = _client(protocol, shm_server)
    client.unregister_system_shared_memory()
    client.unregister_cuda_shared_memory()
    assert _cuda_regions(client) == [] and _system_regions(client) == []

    tag = uuid.uuid4().hex[:8]
    inputs_handle = shm.create_shared_memory_region(f"in_{tag}", f"/kiln_in_{tag}", 2 * TENSOR_BYTES)
    try:
        in0, in1 = np.arange(16, dtype=np.int32).reshape(1, 16), np.full((1, 16), 2, dtype=np.int32)
        shm.set_shared_memory_region(inputs_handle, [in0, in1])
        client.register_system_shared_memory(f"in_{tag}", f"/kiln_in_{tag}", 2 * TENSOR_BYTES)
        inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory(f"in_{tag}", TENSOR_BYTES)
        inputs[1].set_shared_memory(f"in_{tag}", TENSOR_BYTES, offset=TENSOR_BYTES)
        result = client.infer("simple", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), in0 + in1)
        client.unregister_cuda_shared_memory()  # leaves the system region alone
        assert _system_regions(client) == [f"in_{tag}"]
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(inputs_handle)
    assert _system_regions(client) == []


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_status_and_unregister_of_unknown_names(shm_server: KilnProcess, protocol: str) -> None:
    """Triton's answers: unregistering an unknown name does nothing; its status is NOT_FOUND."""
    client = _client(protocol, shm_server)
    client.unregister_cuda_shared_memory("never_registered")
    with pytest.raises(InferenceServerException) as caught:
        _cuda_regions(client, "never_registered")
    assert str(caught.value.status()) in ("404", "StatusCode.NOT_FOUND")
    assert "Unable to find cuda shared memory region: 'never_registered'" in caught.value.message()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_system_region_is_not_a_cuda_region(shm_server: KilnProcess, protocol: str) -> None:
    client = _client(protocol, shm_server)
    tag = uuid.uuid4().hex[:8]
    handle = shm.create_shared_memory_region(f"host_{tag}", f"/kiln_host_{tag}", TENSOR_BYTES)
    try:
        client.register_system_shared_memory(f"host_{tag}", f"/kiln_host_{tag}", TENSOR_BYTES)
        with pytest.raises(InferenceServerException) as caught:
            _cuda_regions(client, f"host_{tag}")
        assert str(caught.value.status()) in ("404", "StatusCode.NOT_FOUND")
        assert "is registered as system shared memory, not CUDA shared memory" in caught.value.message()
        client.unregister_cuda_shared_memory(f"host_{tag}")
        assert _system_regions(client) == [f"host_{tag}"]
    finally:
        client.unregister_system_shared_memory(f"host_{tag}")
        shm.destroy_shared_memory_region(handle)


@pytest.mark.skipif(unavailable_reason() is None, reason="this host can serve CUDA shared memory")
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_host_without_cuda_refuses_only_registration(shm_server: KilnProcess, protocol: str) -> None:
    client = _client(protocol, shm_server)
    handle = base64.b64encode(bytes(IPC_HANDLE_BYTES)).decode()
    with pytest.raises(InferenceServerException) as caught:
        client.register_cuda_shared_memory("gpu", handle, 0, TENSOR_BYTES)
    assert str(caught.value.status()) in ("501", "StatusCode.UNIMPLEMENTED")
    assert "CUDA shared memory is not supported on this server: " in caught.value.message()
    assert _cuda_regions(client) == []
    metadata = client.get_server_metadata() if protocol == "http" else client.get_server_metadata(as_json=True)
    assert "system_shared_memory" in metadata["extensions"]
    assert "cuda_shared_memory" not in metadata["extensions"]
