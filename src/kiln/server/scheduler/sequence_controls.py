"""Sequence request parameters and the control tensors (START, END, READY, CORRID) the server feeds the model.

A client marks a request's sequence with the parameters ``sequence_id`` (a non-zero uint64 or a non-empty
string), ``sequence_start`` and ``sequence_end``. The model never sees those parameters; it sees control inputs
that the sequence batcher fills, one value per batch row, each row shaped ``[1]`` (Triton's layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.errors import InvalidArgumentError
from kiln.tensor import DataType
from kiln.v2._generated import model_config_pb2 as pb
from kiln.v2.types import InferRequest

Array = npt.NDArray[Any]
SequenceId = int | str

_UINT64_MAX = 2**64 - 1
_Kind = pb.ModelSequenceBatching.Control


@dataclass(frozen=True)
class SequenceParams:
    """What a request says about its sequence."""

    sequence_id: SequenceId
    start: bool
    end: bool


def sequence_params(model: str, request: InferRequest) -> SequenceParams:
    """Read and check ``sequence_id``, ``sequence_start`` and ``sequence_end``."""
    value = request.parameters.get("sequence_id")
    if value is None or value == 0 or value == "":
        shown = "missing" if value is None else repr(value)
        raise InvalidArgumentError(
            f"inference request to model '{model}' must specify a non-zero or non-empty correlation ID: request "
            f"parameter 'sequence_id' is {shown}; send a non-zero integer or a non-empty string")
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise InvalidArgumentError(f"model '{model}': request parameter 'sequence_id' is {value!r}; expected a "
                                   f"non-zero unsigned 64-bit integer or a non-empty string")
    if isinstance(value, int) and not 0 < value <= _UINT64_MAX:
        raise InvalidArgumentError(f"model '{model}': request parameter 'sequence_id' is {value}; expected "
                                   f"1..{_UINT64_MAX} (an unsigned 64-bit integer)")
    return SequenceParams(value, _flag(model, request, "sequence_start"), _flag(model, request, "sequence_end"))


def _flag(model: str, request: InferRequest, key: str) -> bool:
    value = request.parameters.get(key, False)
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"model '{model}': request parameter '{key}' is {value!r}; "
                                   f"expected true or false")
    return value


@dataclass(frozen=True)
class RowControl:
    """The control values of one batch row. A padding row is not ready and carries no sequence."""

    ready: bool
    start: bool = False
    end: bool = False
    sequence_id: SequenceId | None = None


PADDING = RowControl(ready=False)


@dataclass(frozen=True)
class BoolControl:
    """START, END or READY: a false and a true value of INT32, FP32 or BOOL."""

    name: str
    datatype: DataType
    false_value: float | int | bool
    true_value: float | int | bool

    def values(self, flags: Sequence[bool]) -> Array:
        data = [self.true_value if flag else self.false_value for flag in flags]
        return np.asarray(data, dtype=self.datatype.numpy_dtype)


@dataclass(frozen=True)
class CorrIdControl:
    """CORRID: the row's sequence id as an integer type or as a string (0 or empty on padding rows)."""

    name: str
    datatype: DataType

    def check(self, model: str, sequence_id: SequenceId) -> None:
        """Refuse ids the control's data type cannot carry, before the request is queued."""
        if self.datatype is DataType.BYTES:
            return
        if isinstance(sequence_id, str):
            raise InvalidArgumentError(
                f"model '{model}': request parameter 'sequence_id' is the string {sequence_id!r}, but the model's "
                f"CORRID control input '{self.name}' is {self.datatype.config_name}; send an integer sequence_id")
        info = np.iinfo(self.datatype.numpy_dtype)
        if sequence_id > int(info.max):
            raise InvalidArgumentError(
                f"model '{model}': request parameter 'sequence_id' is {sequence_id}, which does not fit the CORRID "
                f"control input '{self.name}' ({self.datatype.config_name}, at most {int(info.max)})")

    def values(self, ids: Sequence[SequenceId | None]) -> Array:
        if self.datatype is DataType.BYTES:
            out = np.empty(len(ids), dtype=object)
            out[:] = [b"" if i is None else str(i).encode("utf-8") for i in ids]
            return out
        return np.asarray([0 if i is None else i for i in ids], dtype=self.datatype.numpy_dtype)


@dataclass(frozen=True)
class SequenceControls:
    start: BoolControl | None = None
    end: BoolControl | None = None
    ready: BoolControl | None = None
    corrid: CorrIdControl | None = None

    @classmethod
    def from_config(cls, batching: pb.ModelSequenceBatching) -> SequenceControls:
        """Read a validated ``sequence_batching`` section (config/validate.py checked names, kinds and values)."""
        found: dict[int, BoolControl | CorrIdControl] = {}
        for control_input in batching.control_input:
            for control in control_input.control:
                found[control.kind] = _control(control_input.name, control)
        corrid = found.get(_Kind.CONTROL_SEQUENCE_CORRID)
        return cls(start=_as_bool(found.get(_Kind.CONTROL_SEQUENCE_START)),
                   end=_as_bool(found.get(_Kind.CONTROL_SEQUENCE_END)),
                   ready=_as_bool(found.get(_Kind.CONTROL_SEQUENCE_READY)),
                   corrid=corrid if isinstance(corrid, CorrIdControl) else None)

    def check(self, model: str, params: SequenceParams) -> None:
        if self.corrid is not None:
            self.corrid.check(model, params.sequence_id)

    def tensors(self, rows: Sequence[RowControl], batching: bool) -> dict[str, Array]:
        """One tensor per configured control: ``[rows, 1]`` when the model batches, else ``[1]``."""
        columns: dict[str, Array] = {}
        for control, flags in ((self.start, [r.start for r in rows]), (self.end, [r.end for r in rows]),
                               (self.ready, [r.ready for r in rows])):
            if control is not None:
                columns[control.name] = control.values(flags)
        if self.corrid is not None:
            columns[self.corrid.name] = self.corrid.values([r.sequence_id for r in rows])
        return {name: column.reshape((len(rows), 1) if batching else (1,)) for name, column in columns.items()}


def _control(name: str, control: pb.ModelSequenceBatching.Control) -> BoolControl | CorrIdControl:
    if control.kind == _Kind.CONTROL_SEQUENCE_CORRID:
        return CorrIdControl(name, DataType.from_config(control.data_type))
    if control.int32_false_true:
        false_value, true_value = control.int32_false_true
        return BoolControl(name, DataType.INT32, false_value, true_value)
    if control.fp32_false_true:
        false_f, true_f = control.fp32_false_true
        return BoolControl(name, DataType.FP32, false_f, true_f)
    false_b, true_b = control.bool_false_true
    return BoolControl(name, DataType.BOOL, false_b, true_b)


def _as_bool(control: BoolControl | CorrIdControl | None) -> BoolControl | None:
    return control if isinstance(control, BoolControl) else None
