"""Infer requests and answers as compact descriptors: a JSON header naming every tensor (name, datatype, shape,
parameters, where its bytes are) followed by the bytes of the tensors that travel inline.

A tensor's bytes are in the raw layout (kiln.v2.layout) and lie either in the sender's arena (``at: [offset,
size]``) or inline after the header (``at: [-1, size]``, in order); a tensor in a client's shared-memory region
has none (``at: null``). One arena slot holds all of a message's tensors; when the arena has no room for them the
whole message goes inline.

The receiver of a request builds numpy views on the arena (no copy) and hands the slot back, through ``release``,
once the last view is gone, which may be after the answer (a shadow version's mirrored request keeps the inputs).

A joined request (kiln.v2.joined) is one descriptor whose tensors hold its members' rows back to back, and whose
header lists the members (``members``: each one's request id and rows, and a 1 after them where the worker held
it back for an answer); the answer to one holds the rows of
``members`` requests. Where a joined request's tensors lie in shared memory, each input and each output asked for
there lists its members' regions in order (``regions``: [region, byte_size, offset] each).
"""

from __future__ import annotations

import struct
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import orjson

from kiln.frontends.handoff.arena import Arena, align
from kiln.tensor import DataType, decode_bytes, element_count
from kiln.v2.joined import rows_of
from kiln.v2.layout import raw_view
from kiln.v2.types import (
    SHM_PARAMETERS,
    InferRequest,
    InferResponse,
    InputTensor,
    OutputTensor,
    RequestedOutput,
    SharedMemoryRef,
    shared_memory_ref,
)

_LENGTH = struct.Struct("<I")
INLINE = -1

Blob = bytes | memoryview


def encode_request(request: InferRequest, arena: Arena | None, routing_key: str | None = None,
                   held: bool = False) -> bytes:
    """The descriptor of a decoded request, its input bytes written into ``arena`` where they fit; ``held``: the
    worker held it back for an answer first."""
    blobs = [None if t.shared_memory is not None else [raw_view(t.data, t.datatype)] for t in request.inputs]
    slot, places, inline = _place(blobs, arena)
    inputs = [{"name": t.name, "datatype": t.datatype.wire_name, "shape": list(t.shape),
               "parameters": dict(t.parameters), "at": at} for t, at in zip(request.inputs, places, strict=True)]
    header: dict[str, Any] = {"model": request.model_name, "version": request.model_version, "id": request.id,
                              "parameters": dict(request.parameters), "inputs": inputs,
                              "outputs": _requested(request), "slot": slot}
    if routing_key is not None:
        header["routing_key"] = routing_key
    if held:
        header["held"] = 1
    return _message(header, inline)


def encode_joined(requests: Sequence[InferRequest], arena: Arena | None, held: Sequence[bool] = ()) -> bytes:
    """The descriptor of requests that share a join key (kiln.v2.joined) as one request: every input holds the
    members' rows in order, written straight into ``arena`` (no joined copy is made first), or, where the inputs
    lie in shared memory, names each member's region (``regions``), as does every output asked for there.
    ``held``: which members the worker held back for an answer first."""
    first = requests[0]
    in_regions = first.inputs[0].shared_memory is not None
    blobs = [None if in_regions else [raw_view(r.inputs[i].data, t.datatype) for r in requests]
             for i, t in enumerate(first.inputs)]
    slot, places, inline = _place(blobs, arena)
    rows = [rows_of(r) for r in requests]
    total = sum(rows)
    inputs: list[dict[str, Any]] = [
        {"name": t.name, "datatype": t.datatype.wire_name, "shape": [total, *t.shape[1:]], "parameters": {}, "at": at}
        for t, at in zip(first.inputs, places, strict=True)]
    if in_regions:
        for i, item in enumerate(inputs):
            item["regions"] = [_region(r.inputs[i].shared_memory) for r in requests]
    outputs = _requested(first)
    for i, item in enumerate(outputs):
        if first.outputs[i].shared_memory is not None:
            item["parameters"] = {k: v for k, v in item["parameters"].items() if k not in SHM_PARAMETERS}
            item["regions"] = [_region(r.outputs[i].shared_memory) for r in requests]
    header: dict[str, Any] = {"model": first.model_name, "version": first.model_version, "id": "", "parameters": {},
              "inputs": inputs, "outputs": outputs, "slot": slot,
              "members": [[r.id, n, 1] if was_held else [r.id, n]
                          for r, n, was_held in zip(requests, rows, held or [False] * len(requests), strict=True)]}
    return _message(header, inline)


def _region(ref: SharedMemoryRef | None) -> list[Any]:
    assert ref is not None  # join_key: every member's tensor is in shared memory where the first's is
    return [ref.region, ref.byte_size, ref.offset]


def _regions(items: Sequence[Sequence[Any]]) -> tuple[SharedMemoryRef, ...]:
    return tuple(SharedMemoryRef(str(region), int(size), int(offset)) for region, size, offset in items)


def _requested(request: InferRequest) -> list[dict[str, Any]]:
    return [{"name": o.name, "classification": o.classification, "parameters": dict(o.parameters)}
            for o in request.outputs]


def decode_request(payload: bytes, arena: Arena | None,
                   release: Callable[[int], None]) -> tuple[InferRequest, str | None]:
    """The request a descriptor stands for, its inputs numpy views on ``arena`` (read-only, as the in-process
    codec's views on a request body are), and the routing key header it carried."""
    header, inline = _split(payload)
    request = _request(header, inline, arena, release)
    request.held = int(header.get("held", 0))
    return request, header.get("routing_key")


class Member(NamedTuple):
    """One client's request in a joined request: its id, its rows, whether its worker held it for an answer."""

    id: str
    rows: int
    held: bool = False


def decode_joined(payload: bytes, arena: Arena | None,
                  release: Callable[[int], None]) -> tuple[InferRequest, list[Member]]:
    """A joined request (``members`` set) and its members, in order."""
    header, inline = _split(payload)
    members = [Member(str(item[0]), int(item[1]), len(item) > 2 and bool(item[2])) for item in header["members"]]
    request = _request(header, inline, arena, release)
    request.members = len(members)
    request.held = sum(member.held for member in members)
    if any("regions" in item for item in header["inputs"]) or any("regions" in o for o in header["outputs"]):
        request.member_rows = tuple(member.rows for member in members)
    return request, members


def member_count(payload: bytes) -> int:
    """How many requests a joined request's descriptor stands for (read alone: to answer each when the rest of
    the descriptor cannot be read)."""
    return len(_split(payload)[0]["members"])


def _request(header: dict[str, Any], inline: memoryview, arena: Arena | None,
             release: Callable[[int], None]) -> InferRequest:
    model = header["model"]
    data = _Data(header["slot"], inline, arena, release)
    inputs: list[InputTensor] = []
    for item in header["inputs"]:
        at = item["at"]
        datatype = DataType.from_wire(item["datatype"])
        shape = tuple(item["shape"])
        parameters = item["parameters"]
        if "regions" in item:
            inputs.append(InputTensor(item["name"], datatype, shape, np.empty(0, datatype.numpy_dtype), {},
                                      member_regions=_regions(item["regions"])))
        elif at is None:
            shm = shared_memory_ref(parameters, f"model '{model}': input '{item['name']}'")
            inputs.append(InputTensor(item["name"], datatype, shape, np.empty(0, datatype.numpy_dtype), parameters,
                                      shm))
        else:
            inputs.append(InputTensor(item["name"], datatype, shape, data.array(datatype, shape, at), parameters))
    outputs = [RequestedOutput(o["name"], o["classification"], o["parameters"],
                               shared_memory_ref(o["parameters"], f"model '{model}': output '{o['name']}'"),
                               _regions(o.get("regions", ())))
               for o in header["outputs"]]
    return InferRequest(model_name=model, model_version=header["version"], inputs=inputs, id=header["id"],
                        outputs=outputs, parameters=header["parameters"])


def encode_response(response: InferResponse, arena: Arena | None, members: int = 1) -> bytes:
    """The descriptor of an answer (to ``members`` requests joined into one), its output bytes written into
    ``arena`` where they fit."""
    blobs = [None if o.shared_memory is not None else [raw_view(o.data, o.datatype)] for o in response.outputs]
    slot, places, inline = _place(blobs, arena)
    outputs = [{"name": o.name, "datatype": o.datatype.wire_name, "shape": [int(d) for d in o.shape],
                "parameters": dict(o.parameters), "at": at,
                "shm": None if o.shared_memory is None else
                [o.shared_memory.region, o.shared_memory.byte_size, o.shared_memory.offset]}
               for o, at in zip(response.outputs, places, strict=True)]
    header: dict[str, Any] = {"model": response.model_name, "version": response.model_version, "id": response.id,
                              "parameters": dict(response.parameters), "outputs": outputs, "slot": slot}
    if members > 1:
        header["members"] = members
    return _message(header, inline)


def decode_response(payload: bytes, arena: Arena | None) -> tuple[InferResponse, int | None]:
    """The answer a descriptor stands for, with views on ``arena``, and the slot to free once it is encoded."""
    response, slot, _ = decode_answer(payload, arena)
    return response, slot


def decode_answer(payload: bytes, arena: Arena | None) -> tuple[InferResponse, int | None, int]:
    """``decode_response``, and how many joined requests the answer is for."""
    header, inline = _split(payload)
    data = _Data(header["slot"], inline, arena, None)
    outputs: list[OutputTensor] = []
    for item in header["outputs"]:
        datatype = DataType.from_wire(item["datatype"])
        shape = tuple(item["shape"])
        if item["shm"] is not None:
            region, byte_size, offset = item["shm"]
            outputs.append(OutputTensor(item["name"], datatype, shape, np.empty(0, datatype.numpy_dtype),
                                        item["parameters"], SharedMemoryRef(region, byte_size, offset)))
        else:
            outputs.append(OutputTensor(item["name"], datatype, shape, data.array(datatype, shape, item["at"]),
                                        item["parameters"]))
    response = InferResponse(model_name=header["model"], model_version=header["version"], outputs=outputs,
                             id=header["id"], parameters=header["parameters"])
    return response, None if header["slot"] is None else header["slot"][0], int(header.get("members", 1))


def response_slot(payload: bytes) -> int | None:
    """The arena slot an answer's outputs lie in (to free it unread: its caller went away)."""
    slot = _split(payload)[0]["slot"]
    return None if slot is None else int(slot[0])


def _place(tensors: Sequence[Sequence[Blob] | None],
           arena: Arena | None) -> tuple[list[int] | None, list[list[int] | None], list[Blob]]:
    """Where each tensor's bytes go, a tensor given as the parts it is made of (one, or a joined request's
    members'), written back to back: (the arena slot as [offset, size] or None, each tensor's ``at``, the parts
    that go inline)."""
    sizes = [None if parts is None else sum(len(p) for p in parts) for parts in tensors]
    total = sum(align(size) for size in sizes if size is not None)
    offset = arena.allocate(total) if arena is not None and total else None
    places: list[list[int] | None] = []
    inline: list[Blob] = []
    cursor = 0
    for parts, size in zip(tensors, sizes, strict=True):
        if parts is None or size is None:
            places.append(None)
        elif offset is None or arena is None:
            places.append([INLINE, size])
            inline.extend(parts)
        else:
            places.append([offset + cursor, size])
            for part in parts:
                arena.write(offset + cursor, part)
                cursor += len(part)
            cursor = align(cursor)
    return None if offset is None else [offset, cursor], places, inline


def _message(header: dict[str, Any], inline: list[Blob]) -> bytes:
    encoded = orjson.dumps(header)
    return b"".join([_LENGTH.pack(len(encoded)), encoded, *inline])


def _split(payload: bytes) -> tuple[dict[str, Any], memoryview]:
    (length,) = _LENGTH.unpack_from(payload)
    header: dict[str, Any] = orjson.loads(memoryview(payload)[_LENGTH.size:_LENGTH.size + length])
    return header, memoryview(payload)[_LENGTH.size + length:]


_WATCHED: dict[int, weakref.ref[npt.NDArray[np.uint8]]] = {}


def _watch(array: npt.NDArray[np.uint8], offset: int, release: Callable[[int], None]) -> None:
    """Call ``release(offset)`` once ``array`` and every view of it are gone (a weak reference's callback:
    cheaper than weakref.finalize, which a request per 100 us notices)."""
    key = id(array)

    def gone(_: object) -> None:
        _WATCHED.pop(key, None)
        release(offset)

    _WATCHED[key] = weakref.ref(array, gone)


class _Data:
    """Tensor bytes of one message: views on its arena slot or on the inline part."""

    def __init__(self, slot: list[int] | None, inline: memoryview, arena: Arena | None,
                 release: Callable[[int], None] | None) -> None:
        self._inline = inline
        self._cursor = 0
        self._slot: npt.NDArray[np.uint8] | None = None
        self._start = 0
        if slot is not None:
            if arena is None:
                raise ValueError("the descriptor names an arena slot but this side has no arena")
            self._start, size = slot
            # Every tensor is a view of this one array, so it lives as long as any of them.
            self._slot = np.frombuffer(arena.view(self._start, size), dtype=np.uint8)
            if release is not None:
                _watch(self._slot, self._start, release)

    def array(self, datatype: DataType, shape: tuple[int, ...], at: list[int]) -> npt.NDArray[Any]:
        where, size = at
        if where == INLINE:
            raw: Any = self._inline[self._cursor:self._cursor + size]
            self._cursor += size
            if datatype is DataType.BYTES:
                return decode_bytes(raw, element_count(shape)).reshape(shape)
            return np.frombuffer(raw, dtype=datatype.numpy_dtype).reshape(shape)
        assert self._slot is not None
        chunk = self._slot[where - self._start:where - self._start + size]
        if datatype is DataType.BYTES:
            return decode_bytes(chunk.data, element_count(shape)).reshape(shape)
        return chunk.view(datatype.numpy_dtype).reshape(shape)
