"""The raw tensor layout both protocols share (HTTP binary data, gRPC raw contents, shared memory): little-endian,
row-major; BYTES elements each a 4-byte little-endian length followed by the bytes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.tensor import DataType, decode_bytes, element_count, encode_bytes


def to_raw(array: npt.ArrayLike, datatype: DataType) -> bytes:
    """A tensor as one ``bytes`` in the raw layout (gRPC's ``raw_*_contents`` entries are bytes)."""
    if datatype is DataType.BYTES:
        return encode_bytes(np.asarray(array, dtype=object))
    return np.ascontiguousarray(array, dtype=datatype.numpy_dtype).tobytes()


def raw_view(array: npt.NDArray[Any], datatype: DataType) -> bytes | memoryview:
    """The raw layout without a copy where the array already has it (HTTP bodies are joined anyway)."""
    if datatype is DataType.BYTES:
        return encode_bytes(array)
    return np.ascontiguousarray(array, dtype=datatype.numpy_dtype).reshape(-1).view(np.uint8).data


def from_raw(datatype: DataType, shape: Sequence[int], data: bytes | memoryview) -> npt.NDArray[Any]:
    """A tensor over raw bytes: a ``numpy.frombuffer`` view (no copy); BYTES as an object array of ``bytes``."""
    if datatype is DataType.BYTES:
        return decode_bytes(data, element_count(shape)).reshape(tuple(shape))
    return np.frombuffer(data, dtype=datatype.numpy_dtype).reshape(tuple(shape))
