"""Infer requests and answers through descriptors: every datatype round-trips, inputs are views on the arena that
hand their slot back only when the last one is gone, and messages that do not fit travel inline."""

from __future__ import annotations

import gc
import os
from typing import Any

import numpy as np
import pytest

from kiln.frontends.handoff.tensors import decode_request, decode_response, encode_request, encode_response
from kiln.tensor import DataType
from kiln.v2.types import InferRequest, InferResponse, InputTensor, OutputTensor, RequestedOutput, SharedMemoryRef

from .._arenas import arena_pair

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="arenas need memfd_create (Linux)")


def _sample(datatype: DataType, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    count = int(np.prod(shape))
    if datatype is DataType.BYTES:
        data = np.empty(count, dtype=object)
        data[:] = [f"e{i}\u00e9".encode() for i in range(count)]
        return data.reshape(shape)
    if datatype is DataType.BOOL:
        return (np.arange(count) % 3 == 0).reshape(shape)
    return (np.arange(count) * 3 - 5).astype(datatype.numpy_dtype).reshape(shape)


@pytest.mark.parametrize("datatype", list(DataType))
@pytest.mark.parametrize("with_arena", [True, False])
def test_every_datatype_round_trips(datatype: DataType, with_arena: bool) -> None:
    writer, reader = arena_pair() if with_arena else (None, None)
    data = _sample(datatype, (2, 3))
    request = InferRequest("m", [InputTensor("x", datatype, (2, 3), data, {"binary_data_size": 7})], "2", "id-1",
                           [RequestedOutput("y", 3, {"binary_data": True})], {"binary_data_output": True, "k": "v"})
    released: list[int] = []
    decoded, key = decode_request(encode_request(request, writer, "abc"), reader, released.append)
    assert key == "abc"
    assert (decoded.model_name, decoded.model_version, decoded.id) == ("m", "2", "id-1")
    assert decoded.parameters == {"binary_data_output": True, "k": "v"}
    assert [(o.name, o.classification, o.parameters) for o in decoded.outputs] == [("y", 3, {"binary_data": True})]
    tensor = decoded.inputs[0]
    assert (tensor.name, tensor.datatype, tensor.shape, tensor.parameters) == ("x", datatype, (2, 3),
                                                                              {"binary_data_size": 7})
    assert tensor.data.dtype == data.dtype
    np.testing.assert_array_equal(tensor.data, data)

    response = InferResponse("m", "2", [OutputTensor("y", datatype, (2, 3), data, {"p": 1})], "id-1", {"r": 2})
    answer, slot = decode_response(encode_response(response, writer), reader)
    assert (slot is not None) == with_arena
    assert (answer.model_name, answer.model_version, answer.id, answer.parameters) == ("m", "2", "id-1", {"r": 2})
    out = answer.outputs[0]
    assert (out.name, out.datatype, out.shape, out.parameters) == ("y", datatype, (2, 3), {"p": 1})
    np.testing.assert_array_equal(out.data, data)


def test_inputs_are_read_only_views_whose_slot_returns_with_the_last_view() -> None:
    writer, reader = arena_pair()
    a, b = np.arange(16, dtype=np.float32).reshape(4, 4), np.ones((3,), np.int64)
    request = InferRequest("m", [InputTensor("a", DataType.FP32, (4, 4), a),
                                 InputTensor("b", DataType.INT64, (3,), b)])
    released: list[int] = []
    decoded, _ = decode_request(encode_request(request, writer), reader, released.append)
    first, second = decoded.inputs[0].data, decoded.inputs[1].data
    assert not first.flags.writeable and first.ctypes.data % 64 == 0 and second.ctypes.data % 64 == 0
    kept = first[1:3]  # a mirror request (shadow traffic) may keep a view past the answer
    del decoded, first, second
    gc.collect()
    assert released == []
    np.testing.assert_array_equal(kept, a[1:3])
    del kept
    gc.collect()
    assert released == [0]
    writer.free(0)
    assert writer.used_bytes == 0


def test_a_message_too_large_for_the_arena_travels_inline_and_slots_are_reused() -> None:
    writer, reader = arena_pair(4096)
    big = np.arange(2048, dtype=np.float32)  # 8 KiB: more than the arena
    small = np.arange(8, dtype=np.float32)
    payloads = [encode_request(InferRequest("m", [InputTensor("x", DataType.FP32, x.shape, x)]), writer)
                for x in (big, small)]
    assert len(payloads[0]) > big.nbytes and len(payloads[1]) < 200  # inline bytes / a descriptor only
    released: list[int] = []
    for payload, expected in zip(payloads, (big, small), strict=True):
        decoded, _ = decode_request(payload, reader, released.append)
        np.testing.assert_array_equal(decoded.inputs[0].data, expected)
        del decoded
    gc.collect()
    assert released == [0]
    for offset in released:
        writer.free(offset)
    again = encode_request(InferRequest("m", [InputTensor("x", DataType.FP32, small.shape, small)]), writer)
    assert len(again) < 200 and writer.used_bytes == 64  # the same slot serves the next request


def test_shared_memory_tensors_carry_their_region_and_no_bytes() -> None:
    writer, reader = arena_pair()
    region = {"shared_memory_region": "in", "shared_memory_byte_size": 64, "shared_memory_offset": 8}
    request = InferRequest("m", [InputTensor("x", DataType.FP32, (16,), np.empty(0, np.float32), region,
                                             SharedMemoryRef("in", 64, 8))],
                           outputs=[RequestedOutput("y", 0, {"shared_memory_region": "out",
                                                             "shared_memory_byte_size": 64})])
    decoded, _ = decode_request(encode_request(request, writer), reader, lambda _: None)
    assert decoded.inputs[0].shared_memory == SharedMemoryRef("in", 64, 8)
    assert decoded.outputs[0].shared_memory == SharedMemoryRef("out", 64, 0)
    assert writer.used_bytes == 0
    response = InferResponse("m", "1", [OutputTensor("y", DataType.FP32, (16,), np.empty(0, np.float32), {},
                                                     SharedMemoryRef("out", 64, 0))])
    answer, slot = decode_response(encode_response(response, writer), reader)
    assert slot is None and answer.outputs[0].shared_memory == SharedMemoryRef("out", 64, 0)
