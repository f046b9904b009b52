"""The KServe V2 request, response and metadata types, free of any transport: what codecs decode into and
encode from, what the Server takes and returns, and what clients hand back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kiln.errors import InvalidArgumentError
from kiln.tensor import DataType

Parameters = Mapping[str, "bool | int | float | str"]

SHM_REGION = "shared_memory_region"
SHM_BYTE_SIZE = "shared_memory_byte_size"
SHM_OFFSET = "shared_memory_offset"
"""The tensor parameters of the shared-memory extension (the same names over HTTP and gRPC)."""
SHM_PARAMETERS = frozenset({SHM_REGION, SHM_BYTE_SIZE, SHM_OFFSET})


@dataclass(frozen=True)
class SharedMemoryRef:
    """Where a tensor's data lives: ``byte_size`` bytes at ``offset`` in a registered shared-memory region."""

    region: str
    byte_size: int
    offset: int = 0


def shared_memory_ref(parameters: Mapping[str, object], where: str) -> SharedMemoryRef | None:
    """The shared-memory location a tensor's parameters name, or None. Region and byte size go together;
    the offset is optional (0)."""
    region, size, offset = (parameters.get(k) for k in (SHM_REGION, SHM_BYTE_SIZE, SHM_OFFSET))
    if region is None and size is None and offset is None:
        return None
    if region is None or size is None:
        raise InvalidArgumentError(f"{where}: parameters {SHM_REGION} and {SHM_BYTE_SIZE} must be given together "
                                   f"(and {SHM_OFFSET} only with them)")
    if not isinstance(region, str) or not region:
        raise InvalidArgumentError(f"{where}: parameter {SHM_REGION} must be a region name, got {region!r}")
    offset = 0 if offset is None else offset
    for key, value in ((SHM_BYTE_SIZE, size), (SHM_OFFSET, offset)):
        if type(value) is not int or value < 0:
            raise InvalidArgumentError(f"{where}: parameter {key} must be a non-negative integer, got {value!r}")
    assert isinstance(size, int) and isinstance(offset, int)
    return SharedMemoryRef(region, size, offset)


@dataclass
class InputTensor:
    """A request input. ``data`` is a numpy array already shaped to ``shape`` (a view over the received bytes
    where the codec could manage it); BYTES data is an object array of ``bytes``. With ``shared_memory`` the
    codec leaves ``data`` empty and the Server fills it from the region before validating the request."""

    name: str
    datatype: DataType
    shape: tuple[int, ...]
    data: npt.NDArray[Any]
    parameters: Parameters = field(default_factory=dict)
    shared_memory: SharedMemoryRef | None = None
    member_regions: tuple[SharedMemoryRef, ...] = ()
    """A joined request's input left where its members' clients put it (kiln.v2.joined): each member's region, in
    order. The Server reads each member's rows from its region into ``parts``, and ``data`` then only stands for
    the shape (a zero-stride array): the batch copies the parts where they lie."""
    parts: tuple[npt.NDArray[Any], ...] = ()


@dataclass
class RequestedOutput:
    """An output the client asked for. ``classification`` > 0 asks for the top-k classes instead of the tensor;
    ``parameters`` keeps the remaining per-output parameters (e.g. ``binary_data``) for the codec;
    ``shared_memory`` asks for the data to be written into a region instead of the response."""

    name: str
    classification: int = 0
    parameters: Parameters = field(default_factory=dict)
    shared_memory: SharedMemoryRef | None = None
    member_regions: tuple[SharedMemoryRef, ...] = ()
    """A joined request's output to be written into its members' regions: each member's rows into its own."""


@dataclass
class InferRequest:
    """``members``: how many clients' requests this one stands for. A frontend worker joins same-shaped requests
    that reach it together into one of their rows stacked (docs/serving.md, "HTTP workers"); statistics and routing
    counts count each member."""

    model_name: str
    inputs: list[InputTensor]
    model_version: str = ""
    id: str = ""
    outputs: list[RequestedOutput] = field(default_factory=list)
    parameters: Parameters = field(default_factory=dict)
    members: int = 1
    member_rows: tuple[int, ...] = ()
    """Each member's rows, for a joined request whose tensors lie in its members' own shared-memory regions
    (``member_regions`` on its inputs and outputs); empty otherwise."""
    held: int = 0
    """How many of the clients' requests it carries a frontend worker held back for an answer before sending them
    (docs/serving.md, "Joined requests"); counted by the statistics."""


@dataclass
class OutputTensor:
    """A response output. With ``shared_memory`` its data is already in that region: codecs send no data."""

    name: str
    datatype: DataType
    shape: tuple[int, ...]
    data: npt.NDArray[Any]
    parameters: Parameters = field(default_factory=dict)
    shared_memory: SharedMemoryRef | None = None


@dataclass
class InferResponse:
    model_name: str
    model_version: str
    outputs: list[OutputTensor]
    id: str = ""
    parameters: Parameters = field(default_factory=dict)

    def arrays(self) -> dict[str, npt.NDArray[Any]]:
        """The outputs by name (what a client usually wants of a response)."""
        return {output.name: output.data for output in self.outputs}


def as_array(datatype: DataType, shape: tuple[int, ...], data: npt.ArrayLike) -> npt.NDArray[Any]:
    """Build a correctly typed array from decoded data (helper for codecs that start from Python values)."""
    return np.asarray(data, dtype=datatype.numpy_dtype).reshape(shape)


class TensorMeta(Protocol):
    """What metadata says of one input or output (``kiln.config.spec.TensorSpec`` is one): ``dims`` exclude the
    batch dimension; -1 means any size; an optional input may be left out."""

    @property
    def name(self) -> str: ...

    @property
    def datatype(self) -> DataType: ...

    @property
    def dims(self) -> tuple[int, ...]: ...

    @property
    def optional(self) -> bool: ...


@dataclass(frozen=True)
class ModelMetadata:
    """A model's metadata document: its served versions and tensors; ``batching`` adds the batch dimension."""

    name: str
    versions: list[str]
    platform: str
    inputs: Sequence[TensorMeta]
    outputs: Sequence[TensorMeta]
    batching: bool
