"""The HTTP codec: JSON and binary tensor data <-> InferRequest / InferResponse, without a server."""

from __future__ import annotations

import gzip
import json
import struct
import zlib
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kiln.config.spec import TensorSpec
from kiln.errors import InvalidArgumentError
from kiln.frontends.http import documents
from kiln.server.registry import IndexEntry
from kiln.server.stats import BatchStats, Duration, ModelStats
from kiln.tensor import DataType, encode_bytes
from kiln.v2 import http_codec as codec
from kiln.v2.http_body import decompress, parse_json
from kiln.v2.types import InferRequest, InferResponse, ModelMetadata, OutputTensor, RequestedOutput


def _input(name: str = "INPUT0", datatype: str | None = "INT32", shape: list[Any] | None = None,
           **extra: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": [1, 4] if shape is None else shape}
    if "data" not in extra and "parameters" not in extra:
        entry["data"] = [1, 2, 3, 4]
    entry.update(extra)
    return entry


def _decode(doc: Any, binary: bytes = b"", header: bool | None = None) -> InferRequest:
    text = json.dumps(doc).encode()
    with_header = bool(binary) if header is None else header
    return codec.decode_request("m", "", text + binary, len(text) if with_header else None)


def _error(doc: Any, binary: bytes = b"", header: bool | None = None) -> str:
    with pytest.raises(InvalidArgumentError) as info:
        _decode(doc, binary, header)
    return str(info.value)


# -- JSON requests -------------------------------------------------------------------------------------------


def test_json_request_becomes_typed_arrays_with_id_outputs_and_parameters() -> None:
    request = _decode({
        "id": "r1",
        "parameters": {"binary_data_output": True, "priority": 2},
        "inputs": [_input(), _input("INPUT1", "FP32", [2, 2], data=[[1.5, 2], [3, 4]])],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False, "classification": 3}}],
    })
    assert request.model_name == "m" and request.id == "r1"
    assert request.parameters == {"binary_data_output": True, "priority": 2}
    first, second = request.inputs
    assert first.datatype is DataType.INT32 and first.shape == (1, 4)
    assert first.data.dtype == np.dtype("<i4") and first.data.tolist() == [[1, 2, 3, 4]]
    assert second.data.dtype == np.dtype("<f4") and second.data.tolist() == [[1.5, 2.0], [3.0, 4.0]]
    assert request.outputs == [RequestedOutput("OUTPUT0", 3, {"binary_data": False, "classification": 3})]


def test_bool_bf16_fp16_and_bytes_json_values() -> None:
    request = _decode({"inputs": [
        _input("B", "BOOL", [3], data=[True, False, True]),
        _input("H", "FP16", [2], data=[0.5, 1]),
        _input("BF", "BF16", [2], data=[1.5, -2]),
        _input("S", "BYTES", [2, 1], data=[["héllo"], [""]]),
    ]})
    b, h, bf, s = (t.data for t in request.inputs)
    assert b.dtype == np.bool_ and b.tolist() == [True, False, True]
    assert h.dtype == np.float16 and h.tolist() == [0.5, 1.0]
    assert bf.dtype == ml_dtypes.bfloat16 and bf.astype(np.float32).tolist() == [1.5, -2.0]
    assert s.dtype == object and s.shape == (2, 1) and s.tolist() == [["héllo".encode()], [b""]]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (_input(data=[1.5, 2, 3, 4]), "field 'data' holds non-integer numbers; INT32 expects integers"),
        (_input(data=[True, False, True, False]), "field 'data' holds booleans; INT32 expects integers"),
        (_input(datatype="BOOL", data=[1, 0, 1, 0]), "field 'data' holds integers; BOOL expects true/false"),
        (_input(datatype="FP32", data=["1", "2", "3", "4"]), "field 'data' holds strings; FP32 expects numbers"),
        (_input(data=[1, None, 3, 4]), "holds mixed or null values"),
        (_input(data=[[1, 2], [3]]), "field 'data' must be a flat or evenly nested list of integers"),
        (_input(datatype="INT8", data=[1, 2, 3, 300]), "holds 300, outside the INT8 range -128..127"),
        (_input(datatype="UINT8", data=[-1, 2, 3, 4]), "holds -1, outside the UINT8 range 0..255"),
        (_input(data=[1, 2, 3]), "field 'data' has 3 elements but shape [1, 4] needs 4"),
        (_input(datatype="BYTES", data=["a", 2, "c", "d"]), "field 'data' holds 2; BYTES expects JSON strings"),
        (_input(datatype="FP33"), "field 'datatype' is 'FP33'; expected one of BOOL, UINT8"),
        (_input(datatype=None), "field 'datatype' must be a string"),
        (_input(shape=[1, -4]), "field 'shape' must be a list of non-negative integers, got [1, -4]"),
        (_input(shape=[1, 2.0]), "field 'shape' must be a list of non-negative integers"),
        ({"name": "INPUT0", "datatype": "INT32", "shape": [1]}, "needs field 'data'"),
        (_input(parameters=[1]), "field 'parameters' must be a JSON object"),
    ],
)
def test_json_input_errors_name_model_input_and_field(entry: dict[str, Any], message: str) -> None:
    text = _error({"inputs": [entry]})
    assert text.startswith("model 'm': input 'INPUT0': ")
    assert message in text


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([1, 2], "the body must be a JSON object with an 'inputs' list"),
        ({"inputs": []}, "field 'inputs' must be a non-empty list"),
        ({"inputs": [7]}, "each entry of 'inputs' must be an object with a string 'name', got 7"),
        ({"inputs": [_input()], "id": 5}, "field 'id' must be a string, got 5"),
        ({"inputs": [_input()], "parameters": {"binary_data_output": 1}}, "binary_data_output must be true or false"),
        ({"inputs": [_input()], "outputs": {"name": "x"}}, "field 'outputs' must be a list"),
        ({"inputs": [_input()], "outputs": [{"nam": "x"}]}, "each entry of 'outputs' must be an object"),
        ({"inputs": [_input()], "outputs": [{"name": "O", "parameters": {"binary_data": "yes"}}]},
         "output 'O': parameters.binary_data must be true or false, got 'yes'"),
        ({"inputs": [_input()], "outputs": [{"name": "O", "parameters": {"classification": -1}}]},
         "output 'O': parameters.classification must be a non-negative integer, got -1"),
        ({"inputs": [_input()], "outputs": [{"name": "O", "parameters": {"classification": True}}]},
         "parameters.classification must be a non-negative integer, got True"),
    ],
)
def test_request_level_errors(doc: Any, message: str) -> None:
    assert message in _error(doc)


def test_malformed_json_names_the_position() -> None:
    with pytest.raises(InvalidArgumentError, match=r"malformed JSON in the inference request at line 1 column 13"):
        codec.decode_request("m", "", b'{"inputs": [}', None)


def test_parse_json_rejects_non_utf8_and_deep_nesting() -> None:
    with pytest.raises(InvalidArgumentError, match="not UTF-8"):
        parse_json(b'{"a": "\xff"}')
    with pytest.raises(InvalidArgumentError, match="nested too deeply"):
        parse_json(b"[" * 100_000 + b"]" * 100_000)


# -- binary requests -----------------------------------------------------------------------------------------


def test_binary_inputs_are_zero_copy_little_endian_views() -> None:
    values = np.arange(4, dtype="<f4")
    strings = [b"ab", b"", b"\x00z"]
    blobs = [values.tobytes(), encode_bytes(strings)]
    doc = {"inputs": [
        {"name": "F", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": len(blobs[0])}},
        {"name": "S", "datatype": "BYTES", "shape": [3], "parameters": {"binary_data_size": len(blobs[1])}},
    ]}
    text = json.dumps(doc).encode()
    body = text + b"".join(blobs)
    request = codec.decode_request("m", "", body, len(text))
    floats, texts = request.inputs
    assert floats.data.dtype == np.dtype("<f4") and floats.data.tolist() == [[0.0, 1.0, 2.0, 3.0]]
    assert np.shares_memory(floats.data, np.frombuffer(body, np.uint8))
    assert texts.data.tolist() == strings


@pytest.mark.parametrize(
    ("size", "binary", "message"),
    [
        (15, b"\x00" * 15, "input 'F': parameters.binary_data_size is 15 but shape [1, 4] of FP32 needs 16 bytes"),
        (16, b"\x00" * 8, "parameters.binary_data_size is 16 but only 8 bytes of binary data remain"),
        (16, b"\x00" * 20, "binary data: 4 bytes follow the last binary input"),
        (-1, b"\x00", "parameters.binary_data_size must be a non-negative integer, got -1"),
    ],
)
def test_binary_framing_errors(size: int, binary: bytes, message: str) -> None:
    doc = {"inputs": [{"name": "F", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": size}}]}
    assert message in _error(doc, binary)


def test_binary_size_without_header_and_data_with_size_are_rejected() -> None:
    doc = {"inputs": [{"name": "F", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 4}}]}
    assert "only 0 bytes of binary data remain" in _error(doc, header=False)
    both = {"inputs": [_input(data=[1, 2, 3, 4], parameters={"binary_data_size": 16})]}
    assert "has both 'data' and parameters.binary_data_size" in _error(both, b"\x00" * 16)


def test_truncated_bytes_tensor_names_the_input() -> None:
    blob = struct.pack("<I", 10) + b"abc"
    doc = {"inputs": [{"name": "S", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 7}}]}
    assert _error(doc, blob).startswith("model 'm': input 'S': BYTES buffer is truncated")


def test_header_length_header() -> None:
    assert codec.header_length(None, 10) is None
    assert codec.header_length("4", 10) == 4
    with pytest.raises(InvalidArgumentError, match="must be a non-negative integer, got 'x'"):
        codec.header_length("x", 10)
    with pytest.raises(InvalidArgumentError, match="Inference-Header-Content-Length is 11 but the request body has "
                                                   "only 10 bytes"):
        codec.header_length("11", 10)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([DataType.INT8, DataType.UINT16, DataType.INT32, DataType.INT64, DataType.FP16,
                           DataType.FP32, DataType.FP64, DataType.BOOL]),
    shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=4),
    data=st.data(),
)
def test_binary_input_round_trips_any_fixed_size_tensor(dtype: DataType, shape: tuple[int, ...],
                                                        data: st.DataObject) -> None:
    array = data.draw(hnp.arrays(dtype.numpy_dtype, shape))
    blob = array.tobytes()
    doc = {"inputs": [{"name": "X", "datatype": dtype.wire_name, "shape": list(shape),
                       "parameters": {"binary_data_size": len(blob)}}]}
    decoded = _decode(doc, blob, header=True).inputs[0].data
    assert decoded.shape == shape and decoded.dtype == array.dtype
    assert decoded.tobytes() == blob


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=12))
def test_json_int32_round_trips(values: list[int]) -> None:
    request = _decode({"inputs": [_input(shape=[len(values)], data=values)]})
    response = InferResponse("m", "1", [OutputTensor("O", DataType.INT32, (len(values),), request.inputs[0].data)])
    body, header = codec.encode_response(response, request)
    assert header is None and json.loads(body)["outputs"][0]["data"] == values


# -- raw binary requests -------------------------------------------------------------------------------------


def _metadata(*inputs: TensorSpec, batching: bool = True) -> ModelMetadata:
    return ModelMetadata("m", ["1"], "identity", list(inputs), [], batching)


def test_raw_body_infers_the_variable_dimension_and_asks_for_binary_outputs() -> None:
    spec = TensorSpec("X", DataType.FP32, (2, -1))
    body = np.arange(6, dtype="<f4").tobytes()
    request = codec.decode_raw_request("m", "3", body, _metadata(spec))
    (tensor,) = request.inputs
    assert tensor.shape == (1, 2, 3) and tensor.data.tolist() == [[[0, 1, 2], [3, 4, 5]]]
    assert request.model_version == "3" and request.parameters == {"binary_data_output": True}


def test_raw_body_bytes_input_is_one_element() -> None:
    spec = TensorSpec("S", DataType.BYTES, (1,))
    request = codec.decode_raw_request("m", "", b"\x00raw\xff", _metadata(spec, batching=False))
    assert request.inputs[0].shape == (1,) and request.inputs[0].data.tolist() == [b"\x00raw\xff"]


@pytest.mark.parametrize(
    ("inputs", "body", "message"),
    [
        ((TensorSpec("A", DataType.FP32, (4,)), TensorSpec("B", DataType.FP32, (4,))), b"", "exactly one input; "
         "this one has 2"),
        ((TensorSpec("X", DataType.FP32, (4,)),), b"\x00" * 12, "12 bytes do not fill shape [1, 4] of FP32"),
        ((TensorSpec("X", DataType.FP32, (-1,)),), b"\x00" * 6, "6 bytes do not fill shape [1, -1] of FP32"),
        ((TensorSpec("X", DataType.FP32, (-1, -1)),), b"", "more than one variable dimension"),
        ((TensorSpec("S", DataType.BYTES, (2,)),), b"ab", "a raw BYTES body is one element"),
    ],
)
def test_raw_body_errors(inputs: tuple[TensorSpec, ...], body: bytes, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match="raw binary request") as info:
        codec.decode_raw_request("m", "", body, _metadata(*inputs))
    assert message in str(info.value)


# -- responses -----------------------------------------------------------------------------------------------


def _response(*outputs: OutputTensor, response_id: str = "") -> InferResponse:
    return InferResponse("m", "1", list(outputs), id=response_id)


def test_json_response_renders_each_type_as_json_values() -> None:
    response = _response(
        OutputTensor("H", DataType.FP16, (2,), np.array([0.5, -1], dtype=np.float16)),
        OutputTensor("BF", DataType.BF16, (1,), np.array([2.5], dtype=ml_dtypes.bfloat16)),
        OutputTensor("B", DataType.BOOL, (1, 2), np.array([[True, False]])),
        OutputTensor("S", DataType.BYTES, (2,), np.array([b"x\xc3\xa9", "y"], dtype=object)),
        response_id="abc",
    )
    body, header = codec.encode_response(response, InferRequest("m", []))
    assert header is None
    assert json.loads(body) == {"model_name": "m", "model_version": "1", "id": "abc", "outputs": [
        {"name": "H", "datatype": "FP16", "shape": [2], "data": [0.5, -1.0]},
        {"name": "BF", "datatype": "BF16", "shape": [1], "data": [2.5]},
        {"name": "B", "datatype": "BOOL", "shape": [1, 2], "data": [True, False]},
        {"name": "S", "datatype": "BYTES", "shape": [2], "data": ["xé", "y"]},
    ]}


def test_binary_response_puts_raw_bytes_after_the_json_header() -> None:
    ints = np.array([[1, -2]], dtype=np.int32)
    strings = np.array([b"ab", b"c"], dtype=object)
    response = _response(OutputTensor("I", DataType.INT32, (1, 2), ints),
                         OutputTensor("S", DataType.BYTES, (2,), strings),
                         OutputTensor("J", DataType.INT32, (1, 2), ints))
    request = InferRequest("m", [], outputs=[RequestedOutput("J", parameters={"binary_data": False})],
                           parameters={"binary_data_output": True})
    body, header = codec.encode_response(response, request)
    assert header is not None
    doc = json.loads(body[:header])
    assert "id" not in doc
    i, s, j = doc["outputs"]
    assert i == {"name": "I", "datatype": "INT32", "shape": [1, 2], "parameters": {"binary_data_size": 8}}
    assert s["parameters"] == {"binary_data_size": 4 + 2 + 4 + 1} and "data" not in s
    assert j["data"] == [1, -2] and "parameters" not in j
    assert body[header:] == struct.pack("<ii", 1, -2) + struct.pack("<I", 2) + b"ab" + struct.pack("<I", 1) + b"c"


def test_non_contiguous_output_is_serialized_row_major() -> None:
    data = np.arange(6, dtype=np.int64).reshape(2, 3).T
    request = InferRequest("m", [], parameters={"binary_data_output": True})
    body, header = codec.encode_response(_response(OutputTensor("T", DataType.INT64, (3, 2), data)), request)
    assert header is not None and np.frombuffer(body[header:], "<i8").tolist() == [0, 3, 1, 4, 2, 5]


# -- other documents -----------------------------------------------------------------------------------------


def test_model_metadata_adds_the_batch_dimension() -> None:
    spec = TensorSpec("X", DataType.FP32, (3,))
    metadata = ModelMetadata("m", ["1", "2"], "onnxruntime_onnx", [spec], [spec], batching=True)
    assert codec.model_metadata_doc(metadata) == {
        "name": "m", "versions": ["1", "2"], "platform": "onnxruntime_onnx",
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [-1, 3]}],
        "outputs": [{"name": "X", "datatype": "FP32", "shape": [-1, 3]}],
    }


def test_statistics_document_has_tritons_shape() -> None:
    stats = ModelStats("m", "1", last_inference_ms=5, inference_count=3, execution_count=2,
                       success=Duration(2, 100), compute_infer=Duration(2, 40))
    stats.batch_stats[2] = BatchStats(2, compute_infer=Duration(1, 30))
    (doc,) = documents.statistics_doc([stats])["model_stats"]
    assert doc["name"] == "m" and doc["version"] == "1" and doc["last_inference"] == 5
    assert (doc["inference_count"], doc["execution_count"]) == (3, 2)
    assert set(doc["inference_stats"]) == {"success", "fail", "queue", "compute_input", "compute_infer",
                                           "compute_output", "cache_hit", "cache_miss"}
    assert doc["inference_stats"]["success"] == {"count": 2, "ns": 100}
    assert doc["batch_stats"] == [{"batch_size": 2, "compute_input": {"count": 0, "ns": 0},
                                   "compute_infer": {"count": 1, "ns": 30}, "compute_output": {"count": 0, "ns": 0}}]
    assert doc["memory_usage"] == [] and doc["response_stats"] == {}


def test_repository_index_documents() -> None:
    assert documents.index_doc([IndexEntry("a", "1", "READY", "")]) == [
        {"name": "a", "version": "1", "state": "READY", "reason": ""}]
    assert documents.index_ready_only(b"") is False
    assert documents.index_ready_only(b'{"ready": true}') is True
    with pytest.raises(InvalidArgumentError, match="optional boolean 'ready', got"):
        documents.index_ready_only(b'{"ready": "yes"}')
    assert documents.control_request(b'{"parameters": {}}', "load", "m") == documents.ControlRequest()
    with pytest.raises(InvalidArgumentError, match="load of model 'm': the body must be a JSON object"):
        documents.control_request(b"[]", "load", "m")


def test_control_request_parameters() -> None:
    body = b'{"parameters": {"config": "{}", "file:1/model.onnx": "AAEC", "unload_dependents": true}}'
    control = documents.control_request(body, "load", "m")
    assert control == documents.ControlRequest(config="{}", files={"file:1/model.onnx": b"\x00\x01\x02"},
                                           unload_dependents=True)
    with pytest.raises(InvalidArgumentError, match="'file:1/x' is not valid base64"):
        documents.control_request(b'{"parameters": {"file:1/x": "%%%"}}', "load", "m")
    with pytest.raises(InvalidArgumentError, match="parameter 'config' must be a string"):
        documents.control_request(b'{"parameters": {"config": {}}}', "load", "m")


# -- content encoding ----------------------------------------------------------------------------------------


def test_decompress_gzip_and_deflate_within_the_limit() -> None:
    data = b'{"inputs": []}' * 10
    assert decompress(gzip.compress(data), "gzip", 1000) == data
    assert decompress(zlib.compress(data), "Deflate", 1000) == data
    assert decompress(data, "identity", 1000) == data


def test_decompress_errors() -> None:
    with pytest.raises(InvalidArgumentError, match=r"decompressed request body of at least 101 bytes exceeds the "
                                                   r"limit of 100 bytes \(--http-max-input-size\)"):
        decompress(gzip.compress(b"\x00" * 10_000), "gzip", 100)
    with pytest.raises(InvalidArgumentError, match="not valid gzip data"):
        decompress(b"not gzip", "gzip", 100)
    with pytest.raises(InvalidArgumentError, match="truncated"):
        decompress(gzip.compress(b"x" * 50)[:-12], "gzip", 100)
    with pytest.raises(InvalidArgumentError, match="Content-Encoding 'br' is not supported; send the request body "
                                                   "as gzip"):
        decompress(b"x", "br", 100)
