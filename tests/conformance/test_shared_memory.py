"""System shared memory with the real tritonclient (HTTP and gRPC) and tritonclient.utils.shared_memory against
`kiln serve --allow-client-shm`, and a server without the flag refusing it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from kiln.testing.serve import KilnProcess

pytestmark = pytest.mark.conformance

TENSOR_BYTES = 16 * 4  # simple: INT32 [1, 16]


def _client(protocol: str, server: KilnProcess) -> Any:
    if protocol == "http":
        return httpclient.InferenceServerClient(server.http_url)
    return grpcclient.InferenceServerClient(server.grpc_url)


def _status(client: Any) -> dict[str, dict[str, Any]]:
    """Region name -> its status, from either client's answer."""
    if isinstance(client, httpclient.InferenceServerClient):
        return {r["name"]: r for r in client.get_system_shared_memory_status()}
    regions = client.get_system_shared_memory_status(as_json=True).get("regions", {})
    # JSON from protobuf leaves out zero values and writes uint64 as strings.
    return {name: {"name": r["name"], "key": r["key"], "offset": int(r.get("offset", 0)),
                   "byte_size": int(r["byte_size"])} for name, r in regions.items()}


@pytest.fixture
def regions() -> Iterator[tuple[str, Any, Any]]:
    """An input object holding INPUT0 and INPUT1, and an output object for OUTPUT0 and OUTPUT1."""
    tag = uuid.uuid4().hex[:8]
    inputs = shm.create_shared_memory_region(f"in_{tag}", f"/kiln_in_{tag}", 2 * TENSOR_BYTES)
    outputs = shm.create_shared_memory_region(f"out_{tag}", f"/kiln_out_{tag}", 2 * TENSOR_BYTES)
    yield tag, inputs, outputs
    shm.destroy_shared_memory_region(inputs)
    shm.destroy_shared_memory_region(outputs)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_infer_with_inputs_and_outputs_in_shared_memory(shm_server: KilnProcess, protocol: str,
                                                        regions: tuple[str, Any, Any]) -> None:
    tag, in_handle, out_handle = regions
    module: Any = httpclient if protocol == "http" else grpcclient
    client = _client(protocol, shm_server)
    assert "system_shared_memory" in _extensions(client)
    in0, in1 = np.arange(16, dtype=np.int32).reshape(1, 16), np.full((1, 16), 3, dtype=np.int32)
    shm.set_shared_memory_region(in_handle, [in0, in1])
    client.register_system_shared_memory(f"in_{tag}", f"/kiln_in_{tag}", 2 * TENSOR_BYTES)
    client.register_system_shared_memory(f"out_{tag}", f"/kiln_out_{tag}", 2 * TENSOR_BYTES)
    assert _status(client)[f"in_{tag}"] == {"name": f"in_{tag}", "key": f"/kiln_in_{tag}", "offset": 0,
                                            "byte_size": 2 * TENSOR_BYTES}

    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory(f"in_{tag}", TENSOR_BYTES)
    inputs[1].set_shared_memory(f"in_{tag}", TENSOR_BYTES, offset=TENSOR_BYTES)
    outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory(f"out_{tag}", TENSOR_BYTES)
    outputs[1].set_shared_memory(f"out_{tag}", TENSOR_BYTES, offset=TENSOR_BYTES)
    result = client.infer("simple", inputs, outputs=outputs)

    out0 = shm.get_contents_as_numpy(out_handle, np.int32, [1, 16])
    out1 = shm.get_contents_as_numpy(out_handle, np.int32, [1, 16], offset=TENSOR_BYTES)
    np.testing.assert_array_equal(out0, in0 + in1)
    np.testing.assert_array_equal(out1, in0 - in1)
    # As Triton: an output written to shared memory is only its name, datatype and shape (the examples read the
    # region with those); over gRPC its raw_output_contents entry is empty.
    output = result.get_output("OUTPUT1")
    if protocol == "http":
        assert output == {"name": "OUTPUT1", "datatype": "INT32", "shape": [1, 16]}
    else:
        assert (output.datatype, list(output.shape), len(output.parameters)) == ("INT32", [1, 16], 0)
        assert list(result.get_response().raw_output_contents) == [b"", b""]

    client.unregister_system_shared_memory(f"in_{tag}")
    assert set(_status(client)) == {f"out_{tag}"}
    client.unregister_system_shared_memory()
    assert _status(client) == {}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_out_of_range_offset_names_the_region(shm_server: KilnProcess, protocol: str,
                                              regions: tuple[str, Any, Any]) -> None:
    tag, _, _ = regions
    module: Any = httpclient if protocol == "http" else grpcclient
    client = _client(protocol, shm_server)
    client.register_system_shared_memory(f"in_{tag}", f"/kiln_in_{tag}", 2 * TENSOR_BYTES)
    try:
        inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory(f"in_{tag}", TENSOR_BYTES, offset=TENSOR_BYTES + 8)
        inputs[1].set_shared_memory(f"in_{tag}", TENSOR_BYTES)
        with pytest.raises(InferenceServerException) as caught:
            client.infer("simple", inputs)
        assert str(caught.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT")
        assert f"region 'in_{tag}'" in caught.value.message()

        with pytest.raises(InferenceServerException) as caught:  # a region larger than its object
            client.register_system_shared_memory(f"big_{tag}", f"/kiln_in_{tag}", 4 * TENSOR_BYTES)
        assert str(caught.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT")
        assert f"big_{tag}" in caught.value.message()

        with pytest.raises(InferenceServerException) as caught:
            client.register_system_shared_memory(f"in_{tag}", f"/kiln_in_{tag}", TENSOR_BYTES)
        assert str(caught.value.status()) in ("400", "StatusCode.ALREADY_EXISTS")
    finally:
        client.unregister_system_shared_memory(f"in_{tag}")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_server_without_the_flag_refuses_shared_memory(kiln_server: KilnProcess, protocol: str,
                                                       regions: tuple[str, Any, Any]) -> None:
    tag, _, _ = regions
    module: Any = httpclient if protocol == "http" else grpcclient
    client = _client(protocol, kiln_server)
    assert "system_shared_memory" not in _extensions(client)
    calls = [lambda: client.register_system_shared_memory(f"in_{tag}", f"/kiln_in_{tag}", TENSOR_BYTES),
             lambda: client.get_system_shared_memory_status(), lambda: client.unregister_system_shared_memory()]
    tensor = module.InferInput("INPUT0", [1, 16], "INT32")
    tensor.set_shared_memory(f"in_{tag}", TENSOR_BYTES)
    other = module.InferInput("INPUT1", [1, 16], "INT32")
    other.set_data_from_numpy(np.zeros((1, 16), np.int32))
    calls.append(lambda: client.infer("simple", [tensor, other]))
    for call in calls:
        with pytest.raises(InferenceServerException) as caught:
            call()
        assert str(caught.value.status()) in ("501", "StatusCode.UNIMPLEMENTED")
        assert "--allow-client-shm" in caught.value.message()


def _extensions(client: Any) -> list[str]:
    if isinstance(client, httpclient.InferenceServerClient):
        return list(client.get_server_metadata()["extensions"])
    return list(client.get_server_metadata(as_json=True)["extensions"])

