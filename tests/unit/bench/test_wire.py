"""The client's wire encodings, read back by kiln's own server codecs (and the reverse), without sockets."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kiln.bench.targets.kserve_grpc import decode_response, encode_request
from kiln.bench.targets.wire import HEADER_LENGTH, decode_http_response, http_body
from kiln.frontends.grpc import codec as grpc_codec
from kiln.frontends.http import codec as http_codec
from kiln.server.request import InferRequest, InferResponse, OutputTensor
from kiln.tensor import DataType

REQUEST = {
    "INPUT0": np.arange(6, dtype=np.int32).reshape(2, 3),
    "SCALE": np.array([[0.5], [1.5]], dtype=np.float16),
    "TEXT": np.array([[b"ab"], [b"c"]], dtype=object),
}
DATATYPES = {"INPUT0": DataType.INT32, "SCALE": DataType.FP16, "TEXT": DataType.BYTES}


def assert_same_inputs(decoded: dict[str, Any]) -> None:
    assert set(decoded) == set(REQUEST)
    for name, array in REQUEST.items():
        assert decoded[name].shape == array.shape
        assert decoded[name].tolist() == array.tolist()


@pytest.mark.parametrize("binary", [True, False])
def test_http_bodies_decode_in_kilns_http_codec(binary: bool) -> None:
    body, headers = http_body(REQUEST, DATATYPES, binary_input=binary, binary_output=True)
    length = headers.get(HEADER_LENGTH)
    assert (length is not None) == binary
    assert headers["Content-Type"] == ("application/octet-stream" if binary else "application/json")
    request = http_codec.decode_request("m", "", body, int(length) if length is not None else None)
    assert_same_inputs({t.name: t.data for t in request.inputs})
    assert request.parameters["binary_data_output"] is True


def response() -> InferResponse:
    return InferResponse("m", "1", [
        OutputTensor("OUT", DataType.FP32, (2, 2), np.array([[1.0, 2.0], [3.0, 4.5]], dtype=np.float32)),
        OutputTensor("LABEL", DataType.BYTES, (1,), np.array([b"cat"], dtype=object)),
    ])


@pytest.mark.parametrize("binary", [True, False])
def test_http_responses_from_kilns_codec_decode_to_arrays(binary: bool) -> None:
    # the server codec picks the output format from the request's binary_data_output parameter
    request = InferRequest("m", [], parameters={"binary_data_output": binary})
    encoded, header_length = http_codec.encode_response(response(), request)
    assert (header_length is not None) == binary
    outputs = decode_http_response(encoded, header_length)
    assert outputs["OUT"].dtype == np.float32 and outputs["OUT"].tolist() == [[1.0, 2.0], [3.0, 4.5]]
    assert outputs["LABEL"].tolist() == [b"cat"]


def test_grpc_requests_decode_in_kilns_grpc_codec() -> None:
    data = encode_request("m", "3", REQUEST, DATATYPES)
    request = grpc_codec.decode_request(grpc_codec.pb.ModelInferRequest.FromString(data))
    assert (request.model_name, request.model_version) == ("m", "3")
    assert_same_inputs({t.name: t.data for t in request.inputs})


def test_grpc_responses_from_kilns_codec_decode_to_arrays() -> None:
    outputs = decode_response(grpc_codec.encode_response(response()).SerializeToString())
    assert outputs["OUT"].tolist() == [[1.0, 2.0], [3.0, 4.5]]
    assert outputs["LABEL"].tolist() == [b"cat"]
