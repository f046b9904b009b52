"""DataType spellings (wire, config, proto number, numpy) and the BYTES length-prefixed codec."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.errors import InvalidArgumentError
from kiln.tensor import DataType, byte_size, decode_bytes, element_count, encode_bytes
from kiln.v2._generated import model_config_pb2 as pb

# wire name, config name, proto number, numpy dtype, bytes per element (triton.md section 2, KServe v2 sizes)
TABLE: list[tuple[str, str, int, np.dtype, int | None]] = [
    ("BOOL", "TYPE_BOOL", 1, np.dtype(np.bool_), 1),
    ("UINT8", "TYPE_UINT8", 2, np.dtype("<u1"), 1),
    ("UINT16", "TYPE_UINT16", 3, np.dtype("<u2"), 2),
    ("UINT32", "TYPE_UINT32", 4, np.dtype("<u4"), 4),
    ("UINT64", "TYPE_UINT64", 5, np.dtype("<u8"), 8),
    ("INT8", "TYPE_INT8", 6, np.dtype("<i1"), 1),
    ("INT16", "TYPE_INT16", 7, np.dtype("<i2"), 2),
    ("INT32", "TYPE_INT32", 8, np.dtype("<i4"), 4),
    ("INT64", "TYPE_INT64", 9, np.dtype("<i8"), 8),
    ("FP16", "TYPE_FP16", 10, np.dtype("<f2"), 2),
    ("FP32", "TYPE_FP32", 11, np.dtype("<f4"), 4),
    ("FP64", "TYPE_FP64", 12, np.dtype("<f8"), 8),
    ("BYTES", "TYPE_STRING", 13, np.dtype(object), None),
    ("BF16", "TYPE_BF16", 14, np.dtype(ml_dtypes.bfloat16), 2),
]
IDS = [row[0] for row in TABLE]


def test_table_covers_every_datatype() -> None:
    assert {row[0] for row in TABLE} == {t.value for t in DataType}


@pytest.mark.parametrize(("wire", "config", "number", "dtype", "size"), TABLE, ids=IDS)
def test_spellings(wire: str, config: str, number: int, dtype: np.dtype, size: int | None) -> None:
    datatype = DataType(wire)
    assert datatype.wire_name == wire
    assert datatype.config_name == config
    assert datatype.config_number == number
    assert pb.DataType.Value(config) == number  # agrees with the generated model_config.proto
    assert datatype.numpy_dtype == dtype
    assert datatype.byte_size == size


@pytest.mark.parametrize(("wire", "config", "number", "dtype", "size"), TABLE, ids=IDS)
def test_lookups_round_trip(wire: str, config: str, number: int, dtype: np.dtype, size: int | None) -> None:
    datatype = DataType(wire)
    assert DataType.from_wire(wire) is datatype
    assert DataType.from_config(config) is datatype
    assert DataType.from_config(number) is datatype
    assert DataType.from_numpy(dtype) is datatype


def test_bytes_is_type_string_in_config_only() -> None:
    assert DataType.BYTES.config_name == "TYPE_STRING"
    assert DataType.from_config("TYPE_STRING") is DataType.BYTES
    assert DataType.from_config(13) is DataType.BYTES
    assert DataType.BF16.config_number == 14
    with pytest.raises(InvalidArgumentError, match="unknown datatype 'STRING'"):
        DataType.from_wire("STRING")
    with pytest.raises(InvalidArgumentError, match="unknown data_type 'TYPE_BYTES'"):
        DataType.from_config("TYPE_BYTES")


def test_from_wire_unknown_lists_valid_names() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        DataType.from_wire("FLOAT32")
    message = str(info.value)
    assert "unknown datatype 'FLOAT32'" in message
    assert "expected one of" in message
    for datatype in DataType:
        assert datatype.wire_name in message


def test_from_wire_is_case_sensitive() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown datatype 'fp32'"):
        DataType.from_wire("fp32")


@pytest.mark.parametrize("value", ["TYPE_FLOAT", "FP32", "TYPE_INVALID", 0, 15, -1])
def test_from_config_unknown_lists_valid_names(value: str | int) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        DataType.from_config(value)
    message = str(info.value)
    assert f"unknown data_type '{value}'" in message
    assert "TYPE_STRING" in message and "TYPE_BF16" in message and "TYPE_FP32" in message
    assert "TYPE_INVALID" not in message.split("expected one of", 1)[1]


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (np.float32, DataType.FP32),
        (">f4", DataType.FP32),  # byte order does not change the type
        ("<i8", DataType.INT64),
        (bool, DataType.BOOL),
        ("S5", DataType.BYTES),
        ("U3", DataType.BYTES),
        (object, DataType.BYTES),
        (ml_dtypes.bfloat16, DataType.BF16),
    ],
)
def test_from_numpy(dtype: object, expected: DataType) -> None:
    assert DataType.from_numpy(dtype) is expected  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["M8[s]", "c8", "V4"])
def test_from_numpy_unknown(dtype: str) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(f"numpy dtype '{np.dtype(dtype)}' has no kiln DataType")):
        DataType.from_numpy(dtype)


# -- sizes


@pytest.mark.parametrize(("shape", "count"), [((), 1), ((0,), 0), ((3,), 3), ((2, 3, 4), 24), ((5, 0, 2), 0)])
def test_element_count(shape: tuple[int, ...], count: int) -> None:
    assert element_count(shape) == count


def test_element_count_accepts_numpy_ints_and_iterators() -> None:
    assert element_count(np.array([2, 3], dtype=np.int64)) == 6
    assert element_count(iter([4, 5])) == 20


@pytest.mark.parametrize(
    ("datatype", "shape", "size"),
    [
        (DataType.FP32, (2, 3), 24),
        (DataType.BOOL, (7,), 7),
        (DataType.FP16, (1, 16), 32),
        (DataType.BF16, (4,), 8),
        (DataType.INT64, (), 8),
        (DataType.UINT8, (0, 5), 0),
        (DataType.BYTES, (2,), None),
    ],
)
def test_byte_size(datatype: DataType, shape: tuple[int, ...], size: int | None) -> None:
    assert byte_size(datatype, shape) == size


def test_byte_size_matches_numpy_nbytes() -> None:
    for datatype in DataType:
        if datatype is DataType.BYTES:
            continue
        array = np.zeros((3, 5), dtype=datatype.numpy_dtype)
        assert byte_size(datatype, array.shape) == array.nbytes


# -- BYTES codec


def test_encode_known_layout() -> None:
    encoded = encode_bytes(np.array([b"abc", b"", b"de"], dtype=object))
    assert encoded == b"\x03\x00\x00\x00abc" + b"\x00\x00\x00\x00" + b"\x02\x00\x00\x00de"


def test_encode_is_row_major_and_little_endian() -> None:
    array = np.array([[b"a", b"bb"], [b"ccc", b"x" * 258]], dtype=object)
    encoded = encode_bytes(array)
    assert encoded == (b"\x01\x00\x00\x00a" + b"\x02\x00\x00\x00bb" + b"\x03\x00\x00\x00ccc"
                       + b"\x02\x01\x00\x00" + b"x" * 258)


def test_encode_str_as_utf8_and_other_buffers() -> None:
    assert encode_bytes(["é"]) == b"\x02\x00\x00\x00\xc3\xa9"
    assert encode_bytes(np.array(["hi"])) == b"\x02\x00\x00\x00hi"  # numpy unicode array
    assert encode_bytes([bytearray(b"xy"), memoryview(b"z")]) == b"\x02\x00\x00\x00xy\x01\x00\x00\x00z"
    assert encode_bytes([7]) == b"\x01\x00\x00\x007"  # anything else: its str(), UTF-8


def test_decode_known_layout() -> None:
    decoded = decode_bytes(b"\x03\x00\x00\x00abc\x00\x00\x00\x00\x02\x00\x00\x00de")
    assert decoded.dtype == np.dtype(object)
    assert decoded.shape == (3,)
    assert decoded.tolist() == [b"abc", b"", b"de"]
    assert all(type(v) is bytes for v in decoded)


def test_decode_with_count_and_from_views() -> None:
    data = b"\x01\x00\x00\x00a\x01\x00\x00\x00b"
    assert decode_bytes(memoryview(data), count=2).tolist() == [b"a", b"b"]
    assert decode_bytes(bytearray(data), count=2).tolist() == [b"a", b"b"]
    assert decode_bytes(np.frombuffer(data, dtype=np.uint8), count=2).tolist() == [b"a", b"b"]


def test_empty_tensor() -> None:
    assert encode_bytes(np.array([], dtype=object)) == b""
    assert encode_bytes(np.empty((0, 3), dtype=object)) == b""
    for decoded in (decode_bytes(b""), decode_bytes(b"", count=0)):
        assert decoded.shape == (0,)
        assert decoded.dtype == np.dtype(object)


def test_truncated_length_prefix() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        decode_bytes(b"\x01\x00\x00\x00a\x02\x00")
    assert str(info.value) == ("BYTES buffer is truncated: element 1 needs a 4-byte length at offset 5, "
                               "but only 2 bytes remain")


def test_truncated_payload() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        decode_bytes(b"\x05\x00\x00\x00ab", count=1)
    assert str(info.value) == "BYTES buffer is truncated: element 0 declares 5 bytes at offset 4, but only 2 remain"


def test_trailing_bytes() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        decode_bytes(b"\x01\x00\x00\x00a\x01\x00\x00\x00b", count=1)
    assert str(info.value) == "BYTES buffer has 5 unexpected bytes after 1 elements"


def test_trailing_bytes_after_zero_elements() -> None:
    with pytest.raises(InvalidArgumentError, match="has 3 unexpected bytes after 0 elements"):
        decode_bytes(b"abc", count=0)


def test_count_mismatch() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        decode_bytes(b"\x01\x00\x00\x00a", count=2)
    assert str(info.value) == "BYTES buffer holds 1 elements, expected 2"


def test_huge_declared_length_is_truncation_not_allocation() -> None:
    with pytest.raises(InvalidArgumentError, match="declares 4294967295 bytes at offset 4, but only 0 remain"):
        decode_bytes(b"\xff\xff\xff\xff")


@settings(deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=20))
def test_round_trip_bytes(values: list[bytes]) -> None:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    encoded = encode_bytes(array)
    assert len(encoded) == sum(4 + len(v) for v in values)
    assert decode_bytes(encoded).tolist() == values
    assert decode_bytes(encoded, count=len(values)).tolist() == values


@settings(deadline=None)
@given(st.lists(st.text(max_size=32), max_size=20))
def test_round_trip_str_as_utf8(values: list[str]) -> None:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    decoded = decode_bytes(encode_bytes(array), count=len(values))
    assert decoded.tolist() == [v.encode("utf-8") for v in values]


@settings(deadline=None)
@given(st.lists(st.binary(max_size=16), min_size=1, max_size=10), st.data())
def test_any_cut_of_a_valid_buffer_is_rejected(values: list[bytes], data: st.DataObject) -> None:
    encoded = encode_bytes(values)
    cut = data.draw(st.integers(min_value=1, max_value=len(encoded) - 1)) if len(encoded) > 1 else None
    if cut is None:
        return
    with pytest.raises(InvalidArgumentError, match="BYTES buffer"):
        decode_bytes(encoded[:cut], count=len(values))
