"""Protocol-free inference requests and responses, as frontends hand them to the Server."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.tensor import DataType

Parameters = Mapping[str, "bool | int | float | str"]


@dataclass
class InputTensor:
    """A request input. ``data`` is a numpy array already shaped to ``shape`` (a view over the received bytes
    where the codec could manage it); BYTES data is an object array of ``bytes``."""

    name: str
    datatype: DataType
    shape: tuple[int, ...]
    data: npt.NDArray[Any]
    parameters: Parameters = field(default_factory=dict)


@dataclass
class RequestedOutput:
    """An output the client asked for. ``classification`` > 0 asks for the top-k classes instead of the tensor;
    ``parameters`` keeps the remaining per-output parameters (e.g. ``binary_data``) for the codec."""

    name: str
    classification: int = 0
    parameters: Parameters = field(default_factory=dict)


@dataclass
class InferRequest:
    model_name: str
    inputs: list[InputTensor]
    model_version: str = ""
    id: str = ""
    outputs: list[RequestedOutput] = field(default_factory=list)
    parameters: Parameters = field(default_factory=dict)


@dataclass
class OutputTensor:
    name: str
    datatype: DataType
    shape: tuple[int, ...]
    data: npt.NDArray[Any]
    parameters: Parameters = field(default_factory=dict)


@dataclass
class InferResponse:
    model_name: str
    model_version: str
    outputs: list[OutputTensor]
    id: str = ""
    parameters: Parameters = field(default_factory=dict)


def as_array(datatype: DataType, shape: tuple[int, ...], data: npt.ArrayLike) -> npt.NDArray[Any]:
    """Build a correctly typed array from decoded data (helper for codecs that start from Python values)."""
    return np.asarray(data, dtype=datatype.numpy_dtype).reshape(shape)
