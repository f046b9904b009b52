"""KServe V2 / Triton HTTP infer bodies <-> kiln's protocol-free types, in both directions.

The server side decodes requests and encodes responses; the client side (:func:`encode_request`,
:func:`decode_response`) does the opposite for kiln's own client. This is the one place that knows the JSON names.

Requests arrive as JSON (``data`` as flat or nested lists) or with the binary tensor data extension: a JSON
header of ``Inference-Header-Content-Length`` bytes followed by each binary input's bytes in order, which become
``numpy.frombuffer`` views (little-endian, zero-copy). A header length of 0 means a raw body: the bytes of the
model's single input. Responses are JSON, or a JSON header plus raw bytes when any output is binary.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from kiln.errors import InvalidArgumentError
from kiln.tensor import MAX_SHAPE_ELEMENTS, DataType, decode_bytes, element_count, shape_fits
from kiln.v2.http_body import parse_json
from kiln.v2.layout import from_raw, raw_view
from kiln.v2.types import (
    InferRequest,
    InferResponse,
    InputTensor,
    ModelMetadata,
    OutputTensor,
    RequestedOutput,
    TensorMeta,
    shared_memory_ref,
)

HEADER_LENGTH = "inference-header-content-length"
"""The binary extension's header: the byte length of the JSON part of the body (lower case, as ASGI has it)."""
JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"

_INTS = frozenset({DataType.INT8, DataType.INT16, DataType.INT32, DataType.INT64,
                   DataType.UINT8, DataType.UINT16, DataType.UINT32, DataType.UINT64})
_FLOATS = frozenset({DataType.FP16, DataType.FP32, DataType.FP64, DataType.BF16})
_NO_PARAMETERS: Mapping[str, Any] = {}
_DATATYPES = {t.wire_name: t for t in DataType}


def _bad(model: str, where: str, problem: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"model '{model}': {where}: {problem}")


# -- requests ------------------------------------------------------------------------------------------------


def header_length(value: str | None, body_size: int) -> int | None:
    """The JSON header's length from ``Inference-Header-Content-Length``; None when the header is absent."""
    if value is None:
        return None
    if not value.strip().isdecimal():
        raise InvalidArgumentError(f"Inference-Header-Content-Length must be a non-negative integer, got '{value}'")
    length = int(value)
    if length > body_size:
        raise InvalidArgumentError(f"Inference-Header-Content-Length is {length} but the request body has only "
                                   f"{body_size} bytes")
    return length


def decode_or_not_found(lookup: Callable[[str, str], object], model: str, version: str, body: bytes,
                        json_size: int | None) -> InferRequest:
    """:func:`decode_request`; when the request is bad, ``lookup(model, version)`` (which raises for a model the
    server does not have) runs first, so that an unknown model is NOT_FOUND whatever else is wrong, as in Triton."""
    try:
        return decode_request(model, version, body, json_size)
    except InvalidArgumentError:
        lookup(model, version)
        raise


def decode_request(model: str, version: str, body: bytes, json_size: int | None) -> InferRequest:
    """Decode a JSON request, or a binary-extension one when ``json_size`` (the header length) is given."""
    header = body if json_size is None else body[:json_size]
    doc = parse_json(header, "inference request") if header else None
    if not isinstance(doc, dict):
        raise _bad(model, "inference request", "the body must be a JSON object with an 'inputs' list")
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise _bad(model, "inference request", "field 'inputs' must be a non-empty list of input tensors")
    offset = len(header)
    tensors: list[InputTensor] = []
    for item in inputs:
        tensor, offset = _input(model, item, body, offset)
        tensors.append(tensor)
    if offset != len(body):
        raise _bad(model, "binary data", f"{len(body) - offset} bytes follow the last binary input; the body "
                                         f"must end where the inputs' binary_data_size values say")
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise _bad(model, "inference request", f"field 'id' must be a string, got {request_id!r}")
    parameters = _parameters(model, "inference request", doc.get("parameters"))
    _check_flag(model, "inference request", parameters, "binary_data_output")
    return InferRequest(model_name=model, model_version=version, inputs=tensors, id=request_id,
                        outputs=_outputs(model, doc.get("outputs")), parameters=parameters)


def _input(model: str, item: object, body: bytes, offset: int) -> tuple[InputTensor, int]:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise _bad(model, "inference request", f"each entry of 'inputs' must be an object with a string 'name', "
                                               f"got {short_json(item)}")
    name: str = item["name"]
    where = f"input '{name}'"
    wire_type = item.get("datatype")
    if not isinstance(wire_type, str):
        raise _bad(model, where, f"field 'datatype' must be a string such as \"FP32\", got {wire_type!r}")
    datatype = _DATATYPES.get(wire_type)
    if datatype is None:
        raise _bad(model, where, f"field 'datatype' is {wire_type!r}; expected one of {', '.join(_DATATYPES)}")
    shape = _shape(model, where, item.get("shape"))
    parameters = _parameters(model, where, item.get("parameters"))
    size = parameters.get("binary_data_size")
    shm = shared_memory_ref(parameters, f"model '{model}': {where}")
    if shm is not None:
        if "data" in item or size is not None:
            raise _bad(model, where, "names a shared memory region, so it must not carry 'data' or "
                                     "parameters.binary_data_size")
        # The Server fills the data from the region.
        return InputTensor(name, datatype, shape, np.empty(0, datatype.numpy_dtype), parameters, shm), offset
    if size is None:
        if "data" not in item:
            raise _bad(model, where, "needs field 'data' (or parameters.binary_data_size with binary data)")
        data = _from_json(model, where, datatype, shape, item["data"])
    else:
        if "data" in item:
            raise _bad(model, where, "has both 'data' and parameters.binary_data_size; send one of them")
        if type(size) is not int or size < 0:
            raise _bad(model, where, f"parameters.binary_data_size must be a non-negative integer, got {size!r}")
        data = _from_binary(model, where, datatype, shape, body, offset, size)
        offset += size
    return InputTensor(name, datatype, shape, data, parameters), offset


def _shape(model: str, where: str, value: object) -> tuple[int, ...]:
    if isinstance(value, list) and all(type(d) is int and d >= 0 for d in value):
        if not shape_fits(value):
            raise _bad(model, where, f"field 'shape' {short_json(value)} describes more than "
                                     f"{MAX_SHAPE_ELEMENTS} elements")
        return tuple(value)
    raise _bad(model, where, f"field 'shape' must be a list of non-negative integers, got {short_json(value)}")


def _parameters(model: str, where: str, value: object) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(model, where, f"field 'parameters' must be a JSON object, got {short_json(value)}")
    return value


def _check_flag(model: str, where: str, parameters: Mapping[str, Any], key: str) -> None:
    if key in parameters and not isinstance(parameters[key], bool):
        raise _bad(model, where, f"parameters.{key} must be true or false, got {parameters[key]!r}")


def _outputs(model: str, value: object) -> list[RequestedOutput]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad(model, "inference request", f"field 'outputs' must be a list, got {short_json(value)}")
    outputs: list[RequestedOutput] = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise _bad(model, "inference request", f"each entry of 'outputs' must be an object with a string "
                                                   f"'name', got {short_json(item)}")
        where = f"output '{item['name']}'"
        parameters = _parameters(model, where, item.get("parameters"))
        _check_flag(model, where, parameters, "binary_data")
        classes = parameters.get("classification", 0)
        if type(classes) is not int or classes < 0:
            raise _bad(model, where, f"parameters.classification must be a non-negative integer, got {classes!r}")
        shm = shared_memory_ref(parameters, f"model '{model}': {where}")
        outputs.append(RequestedOutput(item["name"], classes, parameters, shm))
    return outputs


def _from_json(model: str, where: str, datatype: DataType, shape: tuple[int, ...],
               data: object) -> npt.NDArray[Any]:
    """One ``np.asarray`` over the JSON values, then a kind check so that e.g. 1.5 never becomes INT32 1."""
    if datatype is DataType.BYTES:
        array = _bytes_from_json(model, where, data)
    else:
        try:
            array = np.asarray(data)
        except (ValueError, TypeError, OverflowError):
            raise _bad(model, where, f"field 'data' must be a flat or evenly nested list of {_expected(datatype)}"
                       ) from None
        target = datatype.numpy_dtype
        if array.size and array.dtype.kind not in _json_kinds(datatype):
            raise _bad(model, where, f"field 'data' holds {_found(array)}; {datatype.wire_name} expects "
                                     f"{_expected(datatype)}")
        if datatype in _INTS and array.size and array.dtype != target:
            info = np.iinfo(target)
            low, high = array.min(), array.max()
            if low < info.min or high > info.max:
                raise _bad(model, where, f"field 'data' holds {low if low < info.min else high}, outside the "
                                         f"{datatype.wire_name} range {info.min}..{info.max}")
        if datatype in _FLOATS and array.size and array.dtype.kind in "iuf" and array.dtype != target:
            _check_float_range(model, where, datatype, array)
        array = array.astype(target, copy=False)
    count = element_count(shape)
    if array.size != count:
        raise _bad(model, where, f"field 'data' has {array.size} elements but shape {list(shape)} needs {count}")
    return array.reshape(shape)


def _check_float_range(model: str, where: str, datatype: DataType, array: npt.NDArray[Any]) -> None:
    """A JSON number beyond the type's largest finite value would become inf (numpy warns, the model computes
    on inf): refused, as an INT32 value outside its range is."""
    largest = float(np.abs(array.astype(np.float64)).max())  # ints too: 70000 is beyond FP16
    limit = datatype.largest_finite
    if limit is not None and largest > limit:
        raise _bad(model, where, f"field 'data' holds {largest:g}, beyond the {datatype.wire_name} range "
                                 f"-{limit:g}..{limit:g}")


def _bytes_from_json(model: str, where: str, data: object) -> npt.NDArray[np.object_]:
    flat = np.asarray(data, dtype=object).reshape(-1)
    try:
        values = [element.encode("utf-8") for element in flat.tolist()]
    except (AttributeError, UnicodeEncodeError):
        bad = next((e for e in flat.tolist() if not isinstance(e, str)), "a string with an unpaired surrogate")
        raise _bad(model, where, f"field 'data' holds {short_json(bad)}; BYTES expects JSON strings") from None
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def _json_kinds(datatype: DataType) -> str:
    return "b" if datatype is DataType.BOOL else "iu" if datatype in _INTS else "iuf"


def _expected(datatype: DataType) -> str:
    return "true/false" if datatype is DataType.BOOL else "integers" if datatype in _INTS else "numbers"


def _found(array: npt.NDArray[Any]) -> str:
    kinds = {"b": "booleans", "i": "integers", "u": "integers", "f": "non-integer numbers", "U": "strings"}
    return kinds.get(array.dtype.kind, "mixed or null values")


def _from_binary(model: str, where: str, datatype: DataType, shape: tuple[int, ...], body: bytes, offset: int,
                 size: int) -> npt.NDArray[Any]:
    if offset + size > len(body):
        raise _bad(model, where, f"parameters.binary_data_size is {size} but only {len(body) - offset} bytes of "
                                 f"binary data remain in the body (check Inference-Header-Content-Length)")
    count = element_count(shape)
    if datatype is DataType.BYTES:
        try:
            return decode_bytes(memoryview(body)[offset:offset + size], count).reshape(shape)
        except InvalidArgumentError as exc:
            raise _bad(model, where, str(exc)) from None
    needed = count * datatype.numpy_dtype.itemsize
    if size != needed:
        raise _bad(model, where, f"parameters.binary_data_size is {size} but shape {list(shape)} of "
                                 f"{datatype.wire_name} needs {needed} bytes")
    if count == 0:
        return np.empty(shape, dtype=datatype.numpy_dtype)
    return np.frombuffer(body, dtype=datatype.numpy_dtype, count=count, offset=offset).reshape(shape)


def decode_raw_request(model: str, version: str, body: bytes, metadata: ModelMetadata) -> InferRequest:
    """A body that is just the bytes of the model's single input (``Inference-Header-Content-Length: 0``).

    Batch size 1; the one variable dimension is inferred from the byte length. A BYTES input takes the whole
    body as its one element. Every output is returned binary.
    """
    if len(metadata.inputs) != 1:
        raise _bad(model, "raw binary request", f"Inference-Header-Content-Length: 0 needs a model with exactly "
                                                f"one input; this one has {len(metadata.inputs)}")
    spec = metadata.inputs[0]
    where = f"input '{spec.name}' (raw binary request)"
    dims = [1, *spec.dims] if metadata.batching else list(spec.dims)
    variable = [i for i, d in enumerate(dims) if d < 0]
    if len(variable) > 1:
        raise _bad(model, where, f"the shape {dims} has more than one variable dimension; send a JSON header")
    if spec.datatype is DataType.BYTES:
        shape = tuple(1 if d < 0 else d for d in dims)
        if element_count(shape) != 1:
            raise _bad(model, where, f"a raw BYTES body is one element, but the shape is {dims}")
        data: npt.NDArray[Any] = np.empty(shape, dtype=object)
        data.reshape(-1)[0] = body
    else:
        itemsize = spec.datatype.numpy_dtype.itemsize
        fixed = element_count(d for d in dims if d >= 0) * itemsize
        if variable and fixed and len(body) % fixed == 0:
            dims[variable[0]] = len(body) // fixed
        if element_count(dims) * itemsize != len(body) or any(d < 0 for d in dims):
            raise _bad(model, where, f"{len(body)} bytes do not fill shape {dims} of {spec.datatype.wire_name}")
        shape = tuple(dims)
        data = np.frombuffer(body, dtype=spec.datatype.numpy_dtype).reshape(shape)
    tensor = InputTensor(spec.name, spec.datatype, shape, data)
    return InferRequest(model_name=model, model_version=version, inputs=[tensor],
                        parameters={"binary_data_output": True})


# -- responses -----------------------------------------------------------------------------------------------


def encode_response(response: InferResponse, request: InferRequest) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary outputs follow it (else None)."""
    binary_default = bool(request.parameters.get("binary_data_output", False))
    asked = {output.name: output.parameters for output in request.outputs}
    blobs: list[bytes | memoryview] = []
    outputs: list[dict[str, Any]] = []
    for output in response.outputs:
        binary = asked.get(output.name, _NO_PARAMETERS).get("binary_data", binary_default)
        entry: dict[str, Any] = {"name": output.name, "datatype": output.datatype.wire_name,
                                 "shape": [int(d) for d in output.shape]}
        # As Triton: an output in shared memory is name, datatype and shape only, and "parameters" appears only
        # as {"binary_data_size": n} (Triton's C++ client reads nothing else there, and insists on that key).
        if output.shared_memory is None and binary:
            blob = raw_view(output.data, output.datatype)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif output.shared_memory is None:
            entry["data"] = _to_json(output)
        outputs.append(entry)
    doc: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        doc["id"] = response.id
    if response.parameters:
        doc["parameters"] = dict(response.parameters)
    doc["outputs"] = outputs
    header = encode_json(doc)
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


def encode_json(doc: Any) -> bytes:
    return orjson.dumps(doc)


def _to_json(output: OutputTensor) -> list[Any]:
    flat = output.data.reshape(-1)
    if output.datatype is DataType.BYTES:
        return [e.decode("utf-8", "replace") if isinstance(e, bytes) else str(e) for e in flat.tolist()]
    if output.datatype is DataType.BF16:
        flat = flat.astype(np.float32)
    result: list[Any] = flat.tolist()
    return result


def short_json(value: object) -> str:
    """A value as it would read in JSON, cut to 60 characters for error messages."""
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."



# -- metadata --------------------------------------------------------------------------------------------


def model_metadata_doc(metadata: ModelMetadata) -> dict[str, Any]:
    """Shapes carry the batch dimension as -1 when the model batches, as Triton reports them."""
    batch = [-1] if metadata.batching else []

    def tensors(specs: Sequence[TensorMeta]) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype.wire_name, "shape": [*batch, *t.dims]} for t in specs]

    return {"name": metadata.name, "versions": list(metadata.versions), "platform": metadata.platform,
            "inputs": tensors(metadata.inputs), "outputs": tensors(metadata.outputs)}



# -- the client side ---------------------------------------------------------------------------------------------


def encode_request(inputs: Mapping[str, npt.NDArray[Any]], *, datatypes: Mapping[str, DataType] | None = None,
                   binary_input: bool = True, binary_output: bool = True, outputs: Sequence[str] = (),
                   parameters: Mapping[str, Any] | None = None, request_id: str = "") -> tuple[bytes, dict[str, str]]:
    """An infer request body and its headers. ``datatypes`` names each input's wire type where the array's dtype
    does not say it (e.g. BYTES from an object array is found anyway); ``outputs`` asks for those outputs only."""
    entries: list[dict[str, Any]] = []
    blobs: list[bytes | memoryview] = []
    for name, array in inputs.items():
        datatype = (datatypes or {}).get(name) or DataType.from_numpy(array.dtype)
        entry: dict[str, Any] = {"name": name, "datatype": datatype.wire_name, "shape": list(array.shape)}
        if binary_input:
            blob = raw_view(array, datatype)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = _json_values(array, datatype)
        entries.append(entry)
    doc: dict[str, Any] = {"inputs": entries, "parameters": {**(parameters or {}), "binary_data_output": binary_output}}
    if request_id:
        doc["id"] = request_id
    if outputs:
        doc["outputs"] = [{"name": name, "parameters": {"binary_data": binary_output}} for name in outputs]
    header = encode_json(doc)
    if not blobs:
        return header, {"Content-Type": JSON_TYPE}
    return b"".join([header, *blobs]), {"Content-Type": BINARY_TYPE, HEADER_LENGTH: str(len(header))}


def _json_values(array: npt.NDArray[Any], datatype: DataType) -> list[Any]:
    flat = array.reshape(-1)
    if datatype is DataType.BYTES:
        return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in flat.tolist()]
    if datatype in (DataType.FP16, DataType.BF16):
        flat = flat.astype(np.float32)
    values: list[Any] = flat.tolist()
    return values


def decode_response(body: bytes, header_length: int | None) -> InferResponse:
    """An infer response: JSON, or a JSON header of ``header_length`` bytes followed by the binary outputs, which
    become views over ``body``."""
    header = body if header_length is None else body[:header_length]
    doc = parse_json(header, "infer response")
    if not isinstance(doc, dict) or not isinstance(doc.get("outputs", []), list):
        raise InvalidArgumentError(f"the infer response is not a V2 response document: {short_json(doc)}")
    view = memoryview(body)
    offset = len(header)
    outputs: list[OutputTensor] = []
    for item in doc.get("outputs", []):
        datatype = DataType.from_wire(item["datatype"])
        shape = tuple(int(d) for d in item["shape"])
        parameters = dict(item.get("parameters") or {})
        size = parameters.get("binary_data_size")
        if size is not None:
            data = from_raw(datatype, shape, view[offset:offset + int(size)])
            offset += int(size)
        elif datatype is DataType.BYTES:
            data = np.empty(len(item.get("data", [])), dtype=object)
            data[:] = [v.encode() if isinstance(v, str) else bytes(v) for v in item.get("data", [])]
            data = data.reshape(shape)
        else:
            data = np.asarray(item.get("data", []), dtype=datatype.numpy_dtype).reshape(shape)
        outputs.append(OutputTensor(item["name"], datatype, shape, data, parameters))
    return InferResponse(model_name=str(doc.get("model_name", "")), model_version=str(doc.get("model_version", "")),
                         outputs=outputs, id=str(doc.get("id", "")), parameters=dict(doc.get("parameters") or {}))
