"""Tensor data types and the BYTES codec.

:class:`DataType` ties together the three spellings of a tensor type: the wire name used by the KServe V2 /
Triton protocols (``"FP32"``, ``"BYTES"``), the model configuration name (``TYPE_FP32``, ``TYPE_STRING``) with its
proto number, and the numpy dtype. BYTES tensors travel as a 4-byte little-endian length followed by the bytes,
per element, in row-major order.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from kiln.errors import InvalidArgumentError

_LENGTH = struct.Struct("<I")


class DataType(enum.Enum):
    """A tensor element type. The value is the KServe V2 wire name."""

    BOOL = "BOOL"
    UINT8 = "UINT8"
    UINT16 = "UINT16"
    UINT32 = "UINT32"
    UINT64 = "UINT64"
    INT8 = "INT8"
    INT16 = "INT16"
    INT32 = "INT32"
    INT64 = "INT64"
    FP16 = "FP16"
    FP32 = "FP32"
    FP64 = "FP64"
    BF16 = "BF16"
    BYTES = "BYTES"

    @property
    def wire_name(self) -> str:
        return self.value

    @property
    def config_name(self) -> str:
        """The ``data_type`` spelling in config.pbtxt (BYTES is TYPE_STRING there)."""
        return "TYPE_STRING" if self is DataType.BYTES else f"TYPE_{self.value}"

    @property
    def config_number(self) -> int:
        return _CONFIG_NUMBERS[self]

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        """Little-endian numpy dtype; object for BYTES (elements are ``bytes``)."""
        return _NUMPY[self]

    @property
    def largest_finite(self) -> float | None:
        """The largest finite value of a floating-point type (None for the others)."""
        floats = (DataType.FP16, DataType.FP32, DataType.FP64, DataType.BF16)
        return float(ml_dtypes.finfo(self.numpy_dtype).max) if self in floats else None  # type: ignore[no-untyped-call]

    @property
    def byte_size(self) -> int | None:
        """Bytes per element, or None for the variable-size BYTES type."""
        return None if self is DataType.BYTES else _NUMPY[self].itemsize

    @classmethod
    def from_wire(cls, name: str) -> DataType:
        try:
            return cls(name)
        except ValueError:
            expected = ", ".join(t.value for t in cls)
            raise InvalidArgumentError(f"unknown datatype '{name}': expected one of {expected}") from None

    @classmethod
    def from_config(cls, name_or_number: str | int) -> DataType:
        """From ``TYPE_FP32`` / ``TYPE_STRING`` or the proto enum number."""
        for datatype, number in _CONFIG_NUMBERS.items():
            if name_or_number in (number, datatype.config_name):
                return datatype
        expected = ", ".join(t.config_name for t in cls)
        raise InvalidArgumentError(f"unknown data_type '{name_or_number}': expected one of {expected}")

    @classmethod
    def from_numpy(cls, dtype: npt.DTypeLike) -> DataType:
        dt = np.dtype(dtype)
        if dt.kind in ("O", "S", "U"):
            return cls.BYTES
        for datatype, candidate in _NUMPY.items():
            if datatype is not DataType.BYTES and candidate == dt.newbyteorder("<"):
                return datatype
        raise InvalidArgumentError(f"numpy dtype '{dt}' has no kiln DataType")


_CONFIG_NUMBERS: dict[DataType, int] = {
    DataType.BOOL: 1,
    DataType.UINT8: 2,
    DataType.UINT16: 3,
    DataType.UINT32: 4,
    DataType.UINT64: 5,
    DataType.INT8: 6,
    DataType.INT16: 7,
    DataType.INT32: 8,
    DataType.INT64: 9,
    DataType.FP16: 10,
    DataType.FP32: 11,
    DataType.FP64: 12,
    DataType.BYTES: 13,
    DataType.BF16: 14,
}

_NUMPY: dict[DataType, np.dtype[Any]] = {
    DataType.BOOL: np.dtype(np.bool_),
    DataType.UINT8: np.dtype("<u1"),
    DataType.UINT16: np.dtype("<u2"),
    DataType.UINT32: np.dtype("<u4"),
    DataType.UINT64: np.dtype("<u8"),
    DataType.INT8: np.dtype("<i1"),
    DataType.INT16: np.dtype("<i2"),
    DataType.INT32: np.dtype("<i4"),
    DataType.INT64: np.dtype("<i8"),
    DataType.FP16: np.dtype("<f2"),
    DataType.FP32: np.dtype("<f4"),
    DataType.FP64: np.dtype("<f8"),
    DataType.BF16: np.dtype(ml_dtypes.bfloat16),
    DataType.BYTES: np.dtype(object),
}


MAX_SHAPE_ELEMENTS = 2**40
"""The most elements a request's tensor shape may describe, a zero dimension counted as one: numpy cannot describe
even an empty array much beyond it, and no real request comes near it."""


def shape_fits(shape: Iterable[int]) -> bool:
    """Whether ``shape`` (non-negative dimensions) stays within :data:`MAX_SHAPE_ELEMENTS`."""
    count = 1
    for dim in shape:
        count *= max(int(dim), 1)
        if count > MAX_SHAPE_ELEMENTS:
            return False
    return True


def element_count(shape: Iterable[int]) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


def _as_bytes(element: object) -> bytes:
    if isinstance(element, bytes):
        return element
    if isinstance(element, str):
        return element.encode("utf-8")
    if isinstance(element, (bytearray, memoryview)):
        return bytes(element)
    return str(element).encode("utf-8")


def encode_bytes(array: npt.ArrayLike) -> bytes:
    """Serialize a BYTES tensor: per element a 4-byte little-endian length, then the bytes (row-major)."""
    flat = np.asarray(array, dtype=object).reshape(-1)
    parts: list[bytes] = []
    for element in flat:
        data = _as_bytes(element)
        parts.append(_LENGTH.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def decode_bytes(buffer: bytes | bytearray | memoryview, count: int | None = None) -> npt.NDArray[np.object_]:
    """Parse a length-prefixed BYTES buffer into a 1-D object array of ``bytes``.

    With ``count`` the buffer must hold exactly that many elements; without it, as many as it holds.
    """
    view = memoryview(buffer).cast("B")
    elements: list[bytes] = []
    offset = 0
    while offset < len(view) and (count is None or len(elements) < count):
        if offset + 4 > len(view):
            raise InvalidArgumentError(
                f"BYTES buffer is truncated: element {len(elements)} needs a 4-byte length at offset {offset}, "
                f"but only {len(view) - offset} bytes remain"
            )
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += 4
        if offset + length > len(view):
            raise InvalidArgumentError(
                f"BYTES buffer is truncated: element {len(elements)} declares {length} bytes at offset {offset}, "
                f"but only {len(view) - offset} remain"
            )
        elements.append(bytes(view[offset : offset + length]))
        offset += length
    if count is not None and len(elements) != count:
        raise InvalidArgumentError(f"BYTES buffer holds {len(elements)} elements, expected {count}")
    if offset != len(view):
        raise InvalidArgumentError(f"BYTES buffer has {len(view) - offset} unexpected bytes after {len(elements)} "
                                   f"elements")
    result = np.empty(len(elements), dtype=object)
    result[:] = elements
    return result


def byte_size(datatype: DataType, shape: Iterable[int]) -> int | None:
    """Size in bytes of a fixed-size tensor, or None for BYTES."""
    size = datatype.byte_size
    return None if size is None else size * element_count(shape)
