"""Both directions of each codec meet: what the client side encodes, the server side decodes (and the reverse),
without sockets."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kiln.tensor import DataType
from kiln.v2 import grpc_codec, http_codec
from kiln.v2.http_codec import HEADER_LENGTH
from kiln.v2.layout import from_raw, to_raw
from kiln.v2.types import InferRequest, InferResponse, OutputTensor

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
    body, headers = http_codec.encode_request(REQUEST, datatypes=DATATYPES, binary_input=binary)
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
    decoded = http_codec.decode_response(encoded, header_length)
    assert (decoded.model_name, decoded.model_version) == ("m", "1")
    outputs = decoded.arrays()
    assert outputs["OUT"].dtype == np.float32 and outputs["OUT"].tolist() == [[1.0, 2.0], [3.0, 4.5]]
    assert outputs["LABEL"].tolist() == [b"cat"]


def test_grpc_requests_decode_in_kilns_grpc_codec() -> None:
    data = grpc_codec.encode_request("m", REQUEST, version="3", datatypes=DATATYPES).SerializeToString()
    request = grpc_codec.decode_request(grpc_codec.pb.ModelInferRequest.FromString(data))
    assert (request.model_name, request.model_version) == ("m", "3")
    assert_same_inputs({t.name: t.data for t in request.inputs})


def test_grpc_responses_from_kilns_codec_decode_to_arrays() -> None:
    message = grpc_codec.pb.ModelInferResponse.FromString(grpc_codec.encode_response(response()).SerializeToString())
    outputs = grpc_codec.decode_response(message).arrays()
    assert outputs["OUT"].tolist() == [[1.0, 2.0], [3.0, 4.5]]
    assert outputs["LABEL"].tolist() == [b"cat"]


def test_client_asks_for_named_outputs_and_sends_parameters_and_id() -> None:
    body, headers = http_codec.encode_request({"INPUT0": REQUEST["INPUT0"]}, outputs=["OUT"], request_id="r7",
                                              parameters={"priority": 2}, binary_input=False, binary_output=False)
    request = http_codec.decode_request("m", "", body, None)
    assert request.id == "r7" and request.parameters["priority"] == 2
    assert [(o.name, o.parameters["binary_data"]) for o in request.outputs] == [("OUT", False)]
    message = grpc_codec.encode_request("m", {"INPUT0": REQUEST["INPUT0"]}, outputs=["OUT"], request_id="r7",
                                        parameters={"priority": 2})
    decoded = grpc_codec.decode_request(message)
    assert decoded.id == "r7" and decoded.parameters["priority"] == 2 and decoded.outputs[0].name == "OUT"


@pytest.mark.parametrize("datatype", [DataType.INT32, DataType.FP16, DataType.BF16, DataType.BOOL, DataType.BYTES])
def test_raw_layout_round_trips(datatype: DataType) -> None:
    array = (np.array([[b"x", b""], [b"yz", b"w"]], dtype=object) if datatype is DataType.BYTES
             else np.arange(4).reshape(2, 2).astype(datatype.numpy_dtype))
    raw = to_raw(array, datatype)
    assert from_raw(datatype, (2, 2), raw).tolist() == array.tolist()
    if datatype is not DataType.BYTES:
        assert len(raw) == 4 * datatype.numpy_dtype.itemsize
