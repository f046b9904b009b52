"""KServe V2 / Triton HTTP wire format <-> kiln's protocol-free types. The only place that knows wire names.

Requests arrive as JSON (``data`` as flat or nested lists) or with the binary tensor data extension: a JSON
header of ``Inference-Header-Content-Length`` bytes followed by each binary input's bytes in order, which become
``numpy.frombuffer`` views (little-endian, zero-copy). A header length of 0 means a raw body: the bytes of the
model's single input. Responses are JSON, or a JSON header plus raw bytes when any output is binary.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from kiln.config.spec import TensorSpec
from kiln.errors import InvalidArgumentError
from kiln.frontends.http.body import parse_json
from kiln.server.cuda_shm import CudaRegionStatus
from kiln.server.registry import IndexEntry
from kiln.server.request import (
    InferRequest,
    InferResponse,
    InputTensor,
    OutputTensor,
    RequestedOutput,
    shared_memory_ref,
)
from kiln.server.server import ModelMetadata
from kiln.server.shm import RegionStatus
from kiln.server.stats import BatchStats, Duration, ModelStats
from kiln.tensor import DataType, decode_bytes, element_count, encode_bytes

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
                                               f"got {_short(item)}")
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
        return tuple(value)
    raise _bad(model, where, f"field 'shape' must be a list of non-negative integers, got {_short(value)}")


def _parameters(model: str, where: str, value: object) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(model, where, f"field 'parameters' must be a JSON object, got {_short(value)}")
    return value


def _check_flag(model: str, where: str, parameters: Mapping[str, Any], key: str) -> None:
    if key in parameters and not isinstance(parameters[key], bool):
        raise _bad(model, where, f"parameters.{key} must be true or false, got {parameters[key]!r}")


def _outputs(model: str, value: object) -> list[RequestedOutput]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad(model, "inference request", f"field 'outputs' must be a list, got {_short(value)}")
    outputs: list[RequestedOutput] = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise _bad(model, "inference request", f"each entry of 'outputs' must be an object with a string "
                                                   f"'name', got {_short(item)}")
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
        array = array.astype(target, copy=False)
    count = element_count(shape)
    if array.size != count:
        raise _bad(model, where, f"field 'data' has {array.size} elements but shape {list(shape)} needs {count}")
    return array.reshape(shape)


def _bytes_from_json(model: str, where: str, data: object) -> npt.NDArray[np.object_]:
    flat = np.asarray(data, dtype=object).reshape(-1)
    try:
        values = [element.encode("utf-8") for element in flat.tolist()]
    except (AttributeError, UnicodeEncodeError):
        bad = next((e for e in flat.tolist() if not isinstance(e, str)), "a string with an unpaired surrogate")
        raise _bad(model, where, f"field 'data' holds {_short(bad)}; BYTES expects JSON strings") from None
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
            blob = _to_binary(output)
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


def _to_binary(output: OutputTensor) -> bytes | memoryview:
    if output.datatype is DataType.BYTES:
        return encode_bytes(output.data)
    array = np.ascontiguousarray(output.data, dtype=output.datatype.numpy_dtype).reshape(-1)
    return array.view(np.uint8).data


def _to_json(output: OutputTensor) -> list[Any]:
    flat = output.data.reshape(-1)
    if output.datatype is DataType.BYTES:
        return [e.decode("utf-8", "replace") if isinstance(e, bytes) else str(e) for e in flat.tolist()]
    if output.datatype is DataType.BF16:
        flat = flat.astype(np.float32)
    result: list[Any] = flat.tolist()
    return result


def _short(value: object) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- other documents -----------------------------------------------------------------------------------------


def model_metadata_doc(metadata: ModelMetadata) -> dict[str, Any]:
    """Shapes carry the batch dimension as -1 when the model batches, as Triton reports them."""
    batch = [-1] if metadata.batching else []

    def tensors(specs: list[TensorSpec]) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype.wire_name, "shape": [*batch, *t.dims]} for t in specs]

    return {"name": metadata.name, "versions": list(metadata.versions), "platform": metadata.platform,
            "inputs": tensors(metadata.inputs), "outputs": tensors(metadata.outputs)}


def statistics_doc(stats: list[ModelStats]) -> dict[str, Any]:
    """The statistics extension's ``{"model_stats": [...]}`` document."""
    return {"model_stats": [_model_stats(s) for s in stats]}


def _model_stats(stats: ModelStats) -> dict[str, Any]:
    inference = {"success": stats.success, "fail": stats.fail, "queue": stats.queue,
                 "compute_input": stats.compute_input, "compute_infer": stats.compute_infer,
                 "compute_output": stats.compute_output, "cache_hit": Duration(), "cache_miss": Duration()}
    return {
        "name": stats.name,
        "version": stats.version,
        "last_inference": stats.last_inference_ms,
        "inference_count": stats.inference_count,
        "execution_count": stats.execution_count,
        "inference_stats": {key: _duration(value) for key, value in inference.items()},
        "response_stats": {},
        "batch_stats": [_batch_stats(stats.batch_stats[size]) for size in sorted(stats.batch_stats)],
        "memory_usage": [],
    }


def _batch_stats(batch: BatchStats) -> dict[str, Any]:
    return {"batch_size": batch.batch_size, "compute_input": _duration(batch.compute_input),
            "compute_infer": _duration(batch.compute_infer), "compute_output": _duration(batch.compute_output)}


def _duration(duration: Duration) -> dict[str, int]:
    return {"count": duration.count, "ns": duration.ns}


def index_doc(entries: list[IndexEntry]) -> list[dict[str, str]]:
    return [{"name": e.name, "version": e.version, "state": e.state, "reason": e.reason} for e in entries]


def index_ready_only(body: bytes) -> bool:
    """The optional ``{"ready": bool}`` body of a repository index request."""
    if not body.strip():
        return False
    doc = parse_json(body, "repository index request")
    ready = doc.get("ready", False) if isinstance(doc, dict) else None
    if not isinstance(ready, bool):
        raise InvalidArgumentError(f"repository index: the body must be a JSON object with an optional boolean "
                                   f"'ready', got {_short(doc)}")
    return ready


@dataclass(frozen=True)
class ControlRequest:
    """A load / unload request's parameters: ``config`` (ModelConfig JSON), ``file:<version>/<name>`` contents
    (base64 on the wire), ``unload_dependents``."""

    config: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    unload_dependents: bool = False


def control_request(body: bytes, action: str, model: str) -> ControlRequest:
    """Load / unload bodies are optional JSON objects (``{"parameters": {...}}``); reject anything else."""
    if not body.strip():
        return ControlRequest()
    doc = parse_json(body, f"{action} request")
    if not isinstance(doc, dict):
        raise InvalidArgumentError(f"{action} of model '{model}': the body must be a JSON object")
    parameters = doc.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidArgumentError(f"{action} of model '{model}': 'parameters' must be a JSON object")
    config = parameters.get("config")
    if config is not None and not isinstance(config, str):
        raise InvalidArgumentError(f"{action} of model '{model}': parameter 'config' must be a string holding "
                                   f"the model configuration as JSON")
    files: dict[str, bytes] = {}
    for key, value in parameters.items():
        if key.startswith("file:"):
            files[key] = _base64(action, model, key, value)
    dependents = parameters.get("unload_dependents", False)
    if not isinstance(dependents, bool):
        raise InvalidArgumentError(f"{action} of model '{model}': parameter 'unload_dependents' must be a boolean")
    return ControlRequest(config=config, files=files, unload_dependents=dependents)


def _base64(action: str, model: str, key: str, value: object) -> bytes:
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{action} of model '{model}': parameter '{key}' must be base64 text")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgumentError(f"{action} of model '{model}': parameter '{key}' is not valid base64") from None


def shm_status_doc(regions: list[RegionStatus]) -> list[dict[str, Any]]:
    return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in regions]


def shm_register_request(body: bytes, region: str) -> tuple[str, int, int]:
    """``{"key": str, "offset": int (default 0), "byte_size": int}`` of a system shared-memory registration."""
    where = f"register of shared memory region '{region}'"
    doc = parse_json(body, where) if body.strip() else None
    if not isinstance(doc, dict):
        raise InvalidArgumentError(f"{where}: the body must be a JSON object with 'key', 'offset' and 'byte_size'")
    key, offset, size = doc.get("key"), doc.get("offset", 0), doc.get("byte_size")
    if not isinstance(key, str):
        raise InvalidArgumentError(f"{where}: field 'key' must be the shared memory key (a string), got {key!r}")
    for field_name, value in (("offset", offset), ("byte_size", size)):
        if type(value) is not int or value < 0:
            raise InvalidArgumentError(f"{where}: field '{field_name}' must be a non-negative integer, "
                                       f"got {value!r}")
    assert isinstance(offset, int) and isinstance(size, int)
    return key, offset, size


def cuda_shm_status_doc(regions: list[CudaRegionStatus]) -> list[dict[str, Any]]:
    return [{"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size} for r in regions]


def cuda_shm_register_request(body: bytes, region: str) -> tuple[bytes, int, int]:
    """``{"raw_handle": {"b64": str}, "device_id": int, "byte_size": int}`` of a CUDA shared-memory registration:
    the CUDA IPC handle's bytes, the device and the size."""
    where = f"register of CUDA shared memory region '{region}'"
    doc = parse_json(body, where) if body.strip() else None
    if not isinstance(doc, dict):
        raise InvalidArgumentError(f"{where}: the body must be a JSON object with 'raw_handle', 'device_id' and "
                                   f"'byte_size'")
    handle = doc.get("raw_handle")
    encoded = handle.get("b64") if isinstance(handle, dict) else None
    if not isinstance(encoded, str):
        raise InvalidArgumentError(f"{where}: field 'raw_handle' must be {{\"b64\": <base64 of the CUDA IPC "
                                   f"handle>}}, got {handle!r}")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgumentError(f"{where}: raw_handle.b64 is not valid base64") from None
    device_id, size = doc.get("device_id"), doc.get("byte_size")
    for field_name, value in (("device_id", device_id), ("byte_size", size)):
        if type(value) is not int or value < 0:
            raise InvalidArgumentError(f"{where}: field '{field_name}' must be a non-negative integer, "
                                       f"got {value!r}")
    assert isinstance(device_id, int) and isinstance(size, int)
    return raw, device_id, size
