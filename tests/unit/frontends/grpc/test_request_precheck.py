"""The size check a large serialized ModelInferRequest gets before it is parsed: it refuses exactly what the full
decode refuses for raw sizes, with the same message, and lets everything else through to it."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.errors import InvalidArgumentError
from kiln.v2 import grpc_codec as codec
from kiln.v2._generated import grpc_service_pb2 as pb

LARGE = codec.PRECHECK_BYTES


def _request(*entries: bytes, elements: int = 16, shm_first: bool = False, datatype: str = "INT32") -> bytes:
    message = pb.ModelInferRequest(model_name="simple", model_version="1", id="req")
    message.parameters["priority"].int64_param = 1
    for index, name in enumerate(("INPUT0", "INPUT1")):
        tensor = message.inputs.add(name=name, datatype=datatype)
        tensor.shape.extend([1, elements])
        if shm_first and index == 0:
            tensor.parameters["shared_memory_region"].string_param = "region"
            tensor.parameters["shared_memory_byte_size"].int64_param = elements * 4
    message.raw_input_contents.extend(entries)
    return bytes(message.SerializeToString())


def _full_decode_error(payload: bytes) -> str:
    with pytest.raises(InvalidArgumentError) as caught:
        codec.decode_request(pb.ModelInferRequest.FromString(payload))
    return caught.value.message


@pytest.mark.parametrize("payload", [
    _request(bytes(LARGE), bytes(64)),  # INPUT0 far too large
    _request(bytes(64), bytes(64), bytes(LARGE)),  # one entry too many
    _request(bytes(LARGE), shm_first=True, elements=16),  # INPUT1 (the only raw one) too large
])
def test_refused_before_parsing_with_the_full_decode_message(payload: bytes) -> None:
    with pytest.raises(codec.RefusedRequest) as caught:
        codec.parse_request(payload)
    assert (caught.value.model, caught.value.version) == ("simple", "1")
    assert caught.value.message == _full_decode_error(payload)


def test_right_sizes_pass_and_decode() -> None:
    elements = LARGE // 4
    data = np.arange(elements, dtype=np.int32).tobytes()
    request = codec.decode_request(codec.parse_request(_request(data, data, elements=elements)))
    assert [t.shape for t in request.inputs] == [(1, elements), (1, elements)]
    assert np.array_equal(request.inputs[1].data.ravel(), np.arange(elements, dtype=np.int32))
    assert request.parameters == {"priority": 1}


def test_bytes_inputs_and_broken_payloads_are_left_to_the_full_parse() -> None:
    strings = _request(bytes(LARGE), bytes(64), datatype="BYTES")  # sizes of BYTES are not fixed
    with pytest.raises(InvalidArgumentError) as caught:
        codec.decode_request(codec.parse_request(strings))
    assert not isinstance(caught.value, codec.RefusedRequest)
    with pytest.raises(InvalidArgumentError, match="could not parse the ModelInfer request"):
        codec.parse_request(b"\x0a\xff\xff\xff\x0f" + bytes(LARGE))
    with pytest.raises(InvalidArgumentError, match="could not parse the ModelInfer request"):
        codec.parse_request(_request(bytes(LARGE), bytes(64))[:-10])  # truncated
