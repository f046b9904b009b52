"""The client side of the KServe V2 HTTP format: infer request bodies (binary tensor data extension or JSON) and
response decoding, plus the raw tensor layout gRPC shares. Responses are decoded into numpy arrays, as a real
client would use them, so the bench pays what a client pays."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from kiln.bench.data import Array, Request
from kiln.errors import InvalidArgumentError
from kiln.tensor import DataType, decode_bytes, element_count, encode_bytes

HEADER_LENGTH = "Inference-Header-Content-Length"


def raw_bytes(array: Array, datatype: DataType) -> bytes:
    """A tensor in the raw wire layout: little-endian, row-major; BYTES length-prefixed."""
    if datatype is DataType.BYTES:
        return encode_bytes(array)
    return np.ascontiguousarray(array, dtype=datatype.numpy_dtype).tobytes()


def from_raw(datatype: DataType, shape: list[int], data: bytes | memoryview) -> Array:
    if datatype is DataType.BYTES:
        return decode_bytes(data, element_count(shape)).reshape(shape)
    return np.frombuffer(data, dtype=datatype.numpy_dtype).reshape(shape)


def http_body(request: Request, datatypes: Mapping[str, DataType], binary_input: bool,
              binary_output: bool) -> tuple[bytes, dict[str, str]]:
    """The POST body of an infer request and its extra headers."""
    inputs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, array in request.items():
        datatype = datatypes[name]
        entry: dict[str, Any] = {"name": name, "datatype": datatype.wire_name, "shape": list(array.shape)}
        if binary_input:
            blob = raw_bytes(array, datatype)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = _json_data(array, datatype)
        inputs.append(entry)
    header = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": binary_output}},
                        separators=(",", ":")).encode()
    if not blobs:
        return header, {"Content-Type": "application/json"}
    return b"".join([header, *blobs]), {"Content-Type": "application/octet-stream",
                                        HEADER_LENGTH: str(len(header))}


def _json_data(array: Array, datatype: DataType) -> list[Any]:
    flat = array.reshape(-1)
    if datatype is DataType.BYTES:
        return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in flat.tolist()]
    if datatype in (DataType.FP16, DataType.BF16):
        return [float(v) for v in flat.astype(np.float32).tolist()]
    values: list[Any] = flat.tolist()
    return values


def decode_http_response(body: bytes, header_length: int | None) -> dict[str, Array]:
    """Outputs of an infer response: JSON, or a JSON header of ``header_length`` bytes followed by binary data."""
    header = body if header_length is None else body[:header_length]
    try:
        doc = json.loads(header)
    except ValueError as exc:
        raise InvalidArgumentError(f"the infer response is not JSON ({exc})") from None
    view = memoryview(body)
    offset = len(header)
    outputs: dict[str, Array] = {}
    for item in doc.get("outputs", []):
        datatype = DataType.from_wire(item["datatype"])
        shape = [int(d) for d in item["shape"]]
        size = (item.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            outputs[item["name"]] = from_raw(datatype, shape, view[offset:offset + int(size)])
            offset += int(size)
        elif datatype is DataType.BYTES:
            values = [v.encode() if isinstance(v, str) else bytes(v) for v in item["data"]]
            array = np.empty(len(values), dtype=object)
            array[:] = values
            outputs[item["name"]] = array.reshape(shape)
        else:
            outputs[item["name"]] = np.asarray(item["data"], dtype=datatype.numpy_dtype).reshape(shape)
    return outputs
