"""What a Python model receives and what kiln accepts back: names, data types and shapes against the config."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.config.spec import ModelSpec, TensorSpec
from kiln.errors import InternalError
from kiln.tensor import DataType

Array = npt.NDArray[Any]


def model_inputs(spec: ModelSpec, inputs: Mapping[str, Array]) -> dict[str, Array]:
    """BYTES inputs as object arrays of ``bytes`` (what Triton hands a Python model), reshaped where the config
    asks for it."""
    prepared: dict[str, Array] = {}
    for name, array in inputs.items():
        tensor = spec.input_map.get(name)
        if array.dtype.kind in ("O", "S", "U"):
            array = as_bytes_array(array)
        if tensor is not None and tensor.reshape is not None:
            lead = (array.shape[0],) if spec.batching else ()
            array = array.reshape(lead + tensor.reshape)
        prepared[name] = array
    return prepared


def batch_size(spec: ModelSpec, inputs: Mapping[str, Array]) -> int | None:
    """The rows in this batch, which every output must have too; None without batching or inputs."""
    if not spec.batching or not inputs:
        return None
    return int(next(iter(inputs.values())).shape[0])


def collect_outputs(spec: ModelSpec, produced: Mapping[str, Any], requested: Sequence[str],
                    batch: int | None) -> dict[str, Array]:
    """The requested outputs, checked against the config; outputs nobody asked for are dropped, as in Triton."""
    for name in produced:
        if name not in spec.output_map:
            raise InternalError(f"model '{spec.name}': execute() returned output '{name}', which the config does "
                                f"not declare (declared: {', '.join(spec.output_map)})")
    missing = [name for name in requested if name not in produced]
    if missing:
        returned = ", ".join(produced) or "none"
        raise InternalError(f"model '{spec.name}': execute() did not return output '{missing[0]}', which the "
                            f"request asked for (returned: {returned})")
    return {name: _checked(spec, spec.output_map[name], produced[name], batch) for name in requested}


def as_bytes_array(array: Array) -> Array:
    """An object array of ``bytes`` with the same shape (str elements are UTF-8 encoded)."""
    flat = [_as_bytes(v) for v in array.reshape(-1)]
    out = np.empty(len(flat), dtype=object)
    out[:] = flat
    return out.reshape(array.shape)


def _as_bytes(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview, np.bytes_)):
        return bytes(value)
    return str(value).encode("utf-8")  # as Triton serializes other objects in a BYTES tensor


def _checked(spec: ModelSpec, tensor: TensorSpec, value: Any, batch: int | None) -> Array:
    array = np.asarray(value)
    if tensor.datatype is DataType.BYTES:
        if array.dtype.kind not in ("O", "S", "U"):
            raise InternalError(f"model '{spec.name}': output '{tensor.name}' has dtype {array.dtype}; the config "
                                f"declares TYPE_STRING, so return an object array of bytes (dtype=np.object_)")
        array = as_bytes_array(array)
    elif array.dtype != tensor.datatype.numpy_dtype:
        expected = tensor.datatype.numpy_dtype
        raise InternalError(f"model '{spec.name}': output '{tensor.name}' has dtype {array.dtype}; the config "
                            f"declares {tensor.datatype.config_name} (numpy {expected}); convert with "
                            f".astype(np.{expected.name})")
    _check_shape(spec, tensor, array.shape, batch)
    if tensor.reshape is not None:
        array = array.reshape(array.shape[:1] + tensor.dims if spec.batching else tensor.dims)
    return array


def _check_shape(spec: ModelSpec, tensor: TensorSpec, shape: tuple[int, ...], batch: int | None) -> None:
    dims = tensor.reshape if tensor.reshape is not None else tensor.dims
    rows_ok = not spec.batching or (len(shape) > 0 and batch in (None, shape[0]))
    rest = shape[1:] if spec.batching else shape
    if rows_ok and len(rest) == len(dims) and all(d in (-1, r) for d, r in zip(dims, rest, strict=True)):
        return
    lead = ["batch" if batch is None else batch] if spec.batching else []
    raise InternalError(f"model '{spec.name}': output '{tensor.name}' has shape {list(shape)}; the config expects "
                        f"{[*lead, *dims]} (-1 = any size)")
