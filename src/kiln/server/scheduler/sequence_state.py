"""Implicit state: the server keeps each sequence's state tensors between its requests.

The model reads state ``input_name`` and writes state ``output_name``; the output of request i is the input of
request i+1 of the same sequence. A sequence starts from ``initial_state`` (zeros or a file under the model's
``initial_state/`` folder) or, without one, from zeros with every variable dimension as 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.errors import ConfigError, UnsupportedError
from kiln.tensor import DataType, element_count
from kiln.v2._generated import model_config_pb2 as pb

Array = npt.NDArray[Any]
StateRow = dict[str, Array]
"""One sequence's state: state input name -> its tensor without a batch dimension."""

INITIAL_STATE_FOLDER = "initial_state"


@dataclass(frozen=True)
class StateSpec:
    input_name: str
    output_name: str
    datatype: DataType
    dims: tuple[int, ...]
    initial: Array

    def __post_init__(self) -> None:
        self.initial.setflags(write=False)  # shared by every sequence that starts


def load_states(config: pb.ModelConfig, model_path: Path) -> tuple[StateSpec, ...]:
    """The ``state`` entries of a validated config, with their initial tensors read."""
    specs: list[StateSpec] = []
    for state in config.sequence_batching.state:
        datatype = DataType.from_config(state.data_type)
        dims = tuple(int(d) for d in state.dims)
        initial = _initial(config.name, state, datatype, dims, model_path)
        specs.append(StateSpec(state.input_name, state.output_name, datatype, dims, initial))
    return tuple(specs)


def initial_row(specs: Sequence[StateSpec]) -> StateRow:
    return {spec.input_name: spec.initial for spec in specs}


def stack_states(specs: Sequence[StateSpec], rows: Sequence[StateRow | None], batching: bool) -> dict[str, Array]:
    """The state inputs of a batch. Padding rows (None) get zeros shaped like the first real row."""
    model_rows = [row for row in rows if row is not None]
    stacked: dict[str, Array] = {}
    for spec in specs:
        template = model_rows[0][spec.input_name]
        parts = [_zeros(spec.datatype, template.shape) if row is None else row[spec.input_name] for row in rows]
        stacked[spec.input_name] = np.stack(parts) if batching else parts[0]
    return stacked


def split_states(specs: Sequence[StateSpec], outputs: Mapping[str, Array], count: int,
                 batching: bool) -> list[StateRow]:
    """Each row's next state from the state outputs of one execution (copied: the batch output is freed)."""
    if not batching:
        return [{spec.input_name: np.array(outputs[spec.output_name]) for spec in specs}]
    return [{spec.input_name: np.array(outputs[spec.output_name][i]) for spec in specs} for i in range(count)]


def _initial(model: str, state: pb.ModelSequenceBatching.State, datatype: DataType, dims: tuple[int, ...],
             model_path: Path) -> Array:
    if not state.initial_state:
        # Triton leaves the first state uninitialized; zeros are a defined stand-in.
        return _zeros(datatype, tuple(1 if d == -1 else d for d in dims))
    initial = state.initial_state[0]
    shape = tuple(int(d) for d in initial.dims)
    if initial.WhichOneof("state_data") == "zero_data":
        return _zeros(datatype, shape)
    return _from_file(model, state.input_name, initial.data_file, datatype, shape, model_path)


def _zeros(datatype: DataType, shape: tuple[int, ...]) -> Array:
    if datatype is DataType.BYTES:
        return np.full(shape, b"", dtype=object)
    return np.zeros(shape, dtype=datatype.numpy_dtype)


def _from_file(model: str, input_name: str, data_file: str, datatype: DataType, shape: tuple[int, ...],
               model_path: Path) -> Array:
    folder = (model_path / INITIAL_STATE_FOLDER).resolve()
    path = (folder / data_file).resolve()
    if not path.is_relative_to(folder):
        raise ConfigError(f"model '{model}': state '{input_name}' initial_state data_file '{data_file}' points "
                          f"outside {folder}; name a file inside that folder")
    if datatype is DataType.BYTES:
        raise UnsupportedError(f"model '{model}': state '{input_name}' reads a TYPE_STRING initial_state from "
                               f"data_file, which kiln does not support; use zero_data: true")
    if not path.is_file():
        raise ConfigError(f"model '{model}': state '{input_name}' initial_state data_file {path} does not exist; "
                          f"put the row-major tensor bytes there")
    data = path.read_bytes()
    itemsize = datatype.numpy_dtype.itemsize
    needed = element_count(shape) * itemsize
    if len(data) < needed:
        raise ConfigError(f"model '{model}': state '{input_name}' initial_state needs {needed} bytes for "
                          f"{datatype.config_name} {list(shape)}, but {path} has {len(data)}")
    # Like Triton, extra trailing bytes are ignored.
    initial: Array = np.frombuffer(data[:needed], dtype=datatype.numpy_dtype).reshape(shape).copy()
    return initial
