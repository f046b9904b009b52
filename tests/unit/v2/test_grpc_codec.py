"""Edge cases of the gRPC codec: raw vs typed contents, byte sizes, BYTES, FP16/BF16, parameters, responses."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from kiln.errors import InternalError, InvalidArgumentError
from kiln.tensor import DataType, encode_bytes
from kiln.v2 import grpc_codec as codec
from kiln.v2._generated import grpc_service_pb2 as pb
from kiln.v2.types import InferResponse, OutputTensor


def _raw_request(*tensors: tuple[str, str, list[int], bytes], model: str = "m") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    for name, datatype, shape, data in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(data)
    return request


def _invalid(request: pb.ModelInferRequest) -> str:
    with pytest.raises(InvalidArgumentError) as caught:
        codec.decode_request(request)
    return caught.value.message


# -- raw_input_contents ------------------------------------------------------------------------------------------


def test_raw_input_is_a_little_endian_view() -> None:
    data = np.arange(6, dtype="<i4").tobytes()
    request = _raw_request(("X", "INT32", [2, 3], data))
    request.model_version, request.id = "3", "req"
    decoded = codec.decode_request(request)
    (tensor,) = decoded.inputs
    assert (decoded.model_name, decoded.model_version, decoded.id) == ("m", "3", "req")
    assert (tensor.name, tensor.datatype, tensor.shape) == ("X", DataType.INT32, (2, 3))
    assert tensor.data.dtype == np.dtype("<i4")
    assert not tensor.data.flags.owndata  # np.frombuffer: no copy of the received bytes
    np.testing.assert_array_equal(tensor.data, np.arange(6).reshape(2, 3))


@pytest.mark.parametrize(("datatype", "dtype"), [("FP16", np.dtype("<f2")), ("BF16", np.dtype(ml_dtypes.bfloat16)),
                                                 ("BOOL", np.dtype(bool)), ("UINT64", np.dtype("<u8"))])
def test_raw_input_types(datatype: str, dtype: np.dtype[Any]) -> None:
    values = np.array([1, 0, 1, 1], dtype=dtype)
    tensor = codec.decode_request(_raw_request(("X", datatype, [4], values.tobytes()))).inputs[0]
    assert tensor.data.dtype == dtype
    np.testing.assert_array_equal(tensor.data, values)


def test_raw_count_must_match_the_inputs() -> None:
    request = _raw_request(("A", "INT32", [1], b"\x00" * 4))
    request.inputs.add(name="B", datatype="INT32", shape=[1])
    message = _invalid(request)
    assert "model 'm'" in message and "2 input(s) but 1 raw_input_contents" in message


def test_raw_byte_size_must_match_shape_times_itemsize() -> None:
    message = _invalid(_raw_request(("X", "FP32", [2, 3], b"\x00" * 20)))
    assert "model 'm'" in message and "input 'X'" in message
    assert "byte size 20" in message and "expecting 24" in message


def test_raw_and_contents_together_are_rejected() -> None:
    request = _raw_request(("A", "INT32", [1], b"\x00" * 4), ("B", "INT32", [1], b"\x00" * 4))
    request.inputs[1].contents.int_contents.append(1)
    message = _invalid(request)
    assert "input 'B'" in message and "raw_input_contents" in message


def test_raw_bytes_input() -> None:
    tensor = codec.decode_request(_raw_request(("S", "BYTES", [1, 2], encode_bytes([b"ab", b""])))).inputs[0]
    assert tensor.shape == (1, 2)
    assert tensor.data.tolist() == [[b"ab", b""]]


def test_truncated_bytes_input_names_model_and_input() -> None:
    message = _invalid(_raw_request(("S", "BYTES", [2], encode_bytes([b"ab"]) + b"\x05\x00")))
    assert message.startswith("model 'm': input 'S' (BYTES, shape [2]):")


def test_unknown_datatype_and_negative_dims() -> None:
    assert "input 'X' has unknown datatype 'FP8'" in _invalid(_raw_request(("X", "FP8", [1], b"\x00")))
    assert "shape [-1, 2]" in _invalid(_raw_request(("X", "INT8", [-1, 2], b"")))


def test_empty_tensor() -> None:
    tensor = codec.decode_request(_raw_request(("X", "FP32", [0, 4], b""))).inputs[0]
    assert tensor.data.shape == (0, 4)


# -- typed contents ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("datatype", "field", "values"), [
    ("BOOL", "bool_contents", [True, False]),
    ("INT8", "int_contents", [-128, 127]),
    ("INT16", "int_contents", [-3, 4]),
    ("INT32", "int_contents", [-(2**31), 2**31 - 1]),
    ("INT64", "int64_contents", [-(2**63), 2**63 - 1]),
    ("UINT8", "uint_contents", [0, 255]),
    ("UINT16", "uint_contents", [0, 65535]),
    ("UINT32", "uint_contents", [0, 2**32 - 1]),
    ("UINT64", "uint64_contents", [0, 2**64 - 1]),
    ("FP32", "fp32_contents", [0.5, -1.25]),
    ("FP64", "fp64_contents", [1e300, -0.0]),
    ("BYTES", "bytes_contents", [b"x", b""]),
])
def test_typed_contents(datatype: str, field: str, values: list[Any]) -> None:
    request = pb.ModelInferRequest(model_name="m")
    getattr(request.inputs.add(name="X", datatype=datatype, shape=[1, 2]).contents, field).extend(values)
    tensor = codec.decode_request(request).inputs[0]
    assert tensor.data.dtype == DataType(datatype).numpy_dtype
    assert tensor.data.shape == (1, 2)
    assert tensor.data.tolist() == [values]


def test_typed_contents_out_of_range() -> None:
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="X", datatype="INT8", shape=[1]).contents.int_contents.append(300)
    assert "does not fit INT8" in _invalid(request)


def test_typed_contents_count_and_field() -> None:
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="X", datatype="INT32", shape=[2]).contents.fp32_contents.extend([1.0, 2.0])
    message = _invalid(request)
    assert "input 'X' has 0 element(s) in contents.int_contents" in message and "needs 2" in message


@pytest.mark.parametrize("datatype", ["FP16", "BF16"])
def test_half_precision_needs_raw(datatype: str) -> None:
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="X", datatype=datatype, shape=[1]).contents.fp32_contents.append(1.0)
    assert "send its data in raw_input_contents" in _invalid(request)


# -- parameters and requested outputs ----------------------------------------------------------------------------


def test_parameters_decode_every_kind() -> None:
    request = pb.ModelInferRequest(model_name="m")
    request.parameters["b"].bool_param = True
    request.parameters["i"].int64_param = -5
    request.parameters["s"].string_param = "text"
    request.parameters["d"].double_param = 0.25
    request.parameters["u"].uint64_param = 2**64 - 1
    tensor = request.inputs.add(name="X", datatype="INT8", shape=[0])
    tensor.parameters["p"].string_param = "input"
    decoded = codec.decode_request(request)
    assert decoded.parameters == {"b": True, "i": -5, "s": "text", "d": 0.25, "u": 2**64 - 1}
    assert decoded.inputs[0].parameters == {"p": "input"}


def test_a_parameter_without_value_is_invalid() -> None:
    request = pb.ModelInferRequest(model_name="m")
    request.parameters["empty"].SetInParent()
    assert "parameter 'empty' has no value" in _invalid(request)


def test_requested_outputs_and_classification() -> None:
    request = pb.ModelInferRequest(model_name="m")
    request.outputs.add(name="A")
    top = request.outputs.add(name="B")
    top.parameters["classification"].int64_param = 3
    top.parameters["binary_data"].bool_param = True
    outputs = codec.decode_request(request).outputs
    assert [(o.name, o.classification, dict(o.parameters)) for o in outputs] == [
        ("A", 0, {}), ("B", 3, {"binary_data": True})]


def test_classification_must_be_an_integer() -> None:
    request = pb.ModelInferRequest(model_name="m")
    request.outputs.add(name="B").parameters["classification"].string_param = "3"
    assert "output 'B': parameter 'classification'" in _invalid(request)


def test_encode_parameters() -> None:
    message = pb.ModelInferResponse()
    codec.encode_parameters(message.parameters, {"b": np.bool_(True), "i": np.int32(-2), "u": 2**63, "d": 1.5,
                                                 "s": "x"})
    kinds = {key: value.WhichOneof("parameter_choice") for key, value in message.parameters.items()}
    assert kinds == {"b": "bool_param", "i": "int64_param", "u": "uint64_param", "d": "double_param",
                     "s": "string_param"}
    assert codec.decode_parameters(message.parameters, "here") == {"b": True, "i": -2, "u": 2**63, "d": 1.5,
                                                                   "s": "x"}
    with pytest.raises(InternalError, match="parameter 'bad'"):
        codec.encode_parameters(message.parameters, {"bad": [1]})


# -- responses ---------------------------------------------------------------------------------------------------


def _response(*outputs: OutputTensor) -> InferResponse:
    return InferResponse(model_name="m", model_version="2", outputs=list(outputs), id="r",
                         parameters={"sequence_end": True})


def test_response_uses_raw_output_contents() -> None:
    ints = np.arange(6, dtype=np.int32).reshape(2, 3).T  # not C-contiguous: must go out row-major
    big_endian = np.array([1.0, 2.0], dtype=">f4")
    words = np.array([[b"ab"], [b""]], dtype=object)
    message = codec.encode_response(_response(
        OutputTensor("I", DataType.INT32, (3, 2), ints),
        OutputTensor("F", DataType.FP32, (2,), big_endian),
        OutputTensor("S", DataType.BYTES, (2, 1), words, parameters={"note": "x"}),
    ))
    assert (message.model_name, message.model_version, message.id) == ("m", "2", "r")
    assert message.parameters["sequence_end"].bool_param is True
    assert [(o.name, o.datatype, list(o.shape)) for o in message.outputs] == [
        ("I", "INT32", [3, 2]), ("F", "FP32", [2]), ("S", "BYTES", [2, 1])]
    assert not any(o.HasField("contents") for o in message.outputs)
    assert message.outputs[2].parameters["note"].string_param == "x"
    assert message.raw_output_contents[0] == np.ascontiguousarray(ints, dtype="<i4").tobytes()
    assert message.raw_output_contents[1] == np.array([1.0, 2.0], dtype="<f4").tobytes()
    assert message.raw_output_contents[2] == b"\x02\x00\x00\x00ab\x00\x00\x00\x00"


def test_response_into_a_stream_reply() -> None:
    reply = pb.ModelStreamInferResponse()
    codec.encode_response(_response(OutputTensor("H", DataType.FP16, (1,), np.array([0.5], np.float16))),
                          reply.infer_response)
    assert reply.HasField("infer_response") and not reply.error_message
    assert reply.infer_response.raw_output_contents[0] == np.float16(0.5).tobytes()


# -- decoding the serialized request as it came ------------------------------------------------------------------


def _equivalent_cases() -> list[pb.ModelInferRequest]:
    values = np.arange(12, dtype=np.float32)
    with_everything = _raw_request(("X", "FP32", [3, 4], values.tobytes()),
                                   ("S", "BYTES", [1, 2], encode_bytes([b"ab", b""])), model="full")
    with_everything.model_version, with_everything.id = "2", "request-7"
    with_everything.parameters["priority"].int64_param = 3
    with_everything.outputs.add(name="Y").parameters["classification"].int64_param = 2
    shm = _raw_request(("Y", "INT32", [2], np.arange(2, dtype=np.int32).tobytes()))
    in_region = shm.inputs.add(name="X", datatype="FP32", shape=[4])
    in_region.parameters["shared_memory_region"].string_param = "region"
    in_region.parameters["shared_memory_byte_size"].int64_param = 16
    contents = pb.ModelInferRequest(model_name="m")
    contents.inputs.add(name="X", datatype="INT32", shape=[3]).contents.int_contents.extend([1, 2, 3])
    return [with_everything, shm, contents]


def _refusal_cases() -> list[pb.ModelInferRequest]:
    too_few = _raw_request(("A", "INT32", [2], bytes(8)))
    too_few.inputs.add(name="B", datatype="INT32", shape=[2])
    both = _raw_request(("X", "FP32", [1], bytes(4)))
    both.inputs[0].contents.fp32_contents.append(1.0)
    return [too_few, _raw_request(("X", "FP32", [4], bytes(12))), both,
            _raw_request(("X", "FP17", [1], bytes(4))), _raw_request(("X", "FP32", [-1], b""))]


@pytest.mark.parametrize("message", _equivalent_cases(), ids=["raw", "raw-and-shm", "contents"])
def test_the_serialized_request_decodes_as_the_parsed_one(message: pb.ModelInferRequest) -> None:
    payload = message.SerializeToString()
    whole, apart = codec.decode_request(pb.ModelInferRequest.FromString(payload)), codec.decode_serialized(payload)
    assert (apart.model_name, apart.model_version, apart.id, apart.parameters, apart.outputs) == \
        (whole.model_name, whole.model_version, whole.id, whole.parameters, whole.outputs)
    for mine, theirs in zip(apart.inputs, whole.inputs, strict=True):
        assert (mine.name, mine.datatype, mine.shape, mine.parameters, mine.shared_memory) == \
            (theirs.name, theirs.datatype, theirs.shape, theirs.parameters, theirs.shared_memory)
        assert mine.data.dtype == theirs.data.dtype and np.array_equal(mine.data, theirs.data)


def test_raw_inputs_are_views_of_the_received_bytes() -> None:
    values = np.arange(1 << 16, dtype=np.float32)
    payload = _raw_request(("X", "FP32", [1, 1 << 16], values.tobytes())).SerializeToString()
    tensor = codec.decode_serialized(payload).inputs[0]
    received = np.frombuffer(payload, np.uint8)
    start = received.__array_interface__["data"][0]
    at = tensor.data.__array_interface__["data"][0]
    assert start <= at and at + tensor.data.nbytes <= start + len(payload)  # no copy: inside the payload
    assert not tensor.data.flags.writeable and np.array_equal(tensor.data.reshape(-1), values)


@pytest.mark.parametrize("message", _refusal_cases(),
                         ids=["count", "size", "raw-and-contents", "datatype", "negative-dimension"])
def test_a_refused_serialized_request_names_its_model_and_the_parsed_ones_reason(
        message: pb.ModelInferRequest) -> None:
    message.model_name, message.model_version = "named", "4"
    expected = _invalid(message)
    with pytest.raises(codec.RefusedRequest) as caught:
        codec.decode_serialized(message.SerializeToString())
    assert (caught.value.message, caught.value.model, caught.value.version) == (expected, "named", "4")


def test_bytes_that_are_no_request_are_refused_as_before() -> None:
    for payload in (b"\x0a\xff\xff\xff\x0f", b"\x3b\x00"):  # a truncated field; a group (wire type 3) at the top
        with pytest.raises(InvalidArgumentError) as caught:
            codec.decode_serialized(payload)
        assert caught.value.message.startswith("could not parse the ModelInfer request")
        assert not isinstance(caught.value, codec.RefusedRequest)


def test_a_raw_entry_that_is_no_bytes_field_leaves_the_message_to_the_whole_parse() -> None:
    values = np.arange(3, dtype=np.int32)
    # Field 7 once more, as a varint: the whole parse keeps it as an unknown field; it must not become an input.
    payload = _raw_request(("X", "INT32", [3], values.tobytes())).SerializeToString() + b"\x38\x01"
    (tensor,) = codec.decode_serialized(payload).inputs
    assert np.array_equal(tensor.data, values)
    assert np.array_equal(codec.decode_request(pb.ModelInferRequest.FromString(payload)).inputs[0].data, values)
