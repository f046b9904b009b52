"""Validate a request once against the model's spec, before it is queued."""

from __future__ import annotations

import math
from collections.abc import Mapping

from kiln.config.spec import ModelSpec
from kiln.engines.checks import check_shape
from kiln.errors import InvalidArgumentError
from kiln.tensor import element_count
from kiln.v2.types import InferRequest

_UINT64_MAX = 2**64 - 1
_UNSIGNED_PARAMETERS = {"priority": "a priority level", "timeout": "microseconds"}
"""Request parameters every model reads the same way, as Triton's unsigned 64-bit fields."""


def validate_request(spec: ModelSpec, request: InferRequest) -> int:
    """Check names, datatypes, shapes, batch sizes and requested outputs. Returns the request's batch size
    (1 for models without batching)."""
    if request.parameters:
        check_reserved_parameters(spec.name, request.parameters)
    expected = spec.input_map
    seen: set[str] = set()
    for tensor in request.inputs:
        spec_tensor = expected.get(tensor.name)
        if spec_tensor is None:
            raise InvalidArgumentError(f"model '{spec.name}': unexpected input '{tensor.name}'; "
                                       f"expected inputs: {', '.join(expected)}")
        if tensor.name in seen:
            raise InvalidArgumentError(f"model '{spec.name}': input '{tensor.name}' is given more than once")
        seen.add(tensor.name)
        if tensor.datatype is not spec_tensor.datatype:
            raise InvalidArgumentError(f"model '{spec.name}': input '{tensor.name}' has datatype "
                                       f"{tensor.datatype.wire_name}; expected {spec_tensor.datatype.wire_name}")
        check_shape(spec, spec_tensor, tensor.shape)
        # math.prod of the data's shape: a numpy array's size, and a torch tensor's (CUDA shared memory) too.
        if (size := math.prod(tensor.data.shape)) != element_count(tensor.shape):
            raise InvalidArgumentError(f"model '{spec.name}': input '{tensor.name}' has {size} "
                                       f"elements but its shape {list(tensor.shape)} needs "
                                       f"{element_count(tensor.shape)}")
    missing = [t.name for t in spec.inputs if t.name not in seen and not t.optional] \
        if len(seen) != len(expected) else []
    if missing:
        raise InvalidArgumentError(f"model '{spec.name}': missing input(s) {', '.join(missing)}; "
                                   f"expected inputs: {', '.join(expected)}")
    _check_outputs(spec, request)
    return _batch_size(spec, request)


def _check_outputs(spec: ModelSpec, request: InferRequest) -> None:
    if not request.outputs:
        return
    known = spec.output_map
    seen: set[str] = set()
    for output in request.outputs:
        if output.name not in known:
            raise InvalidArgumentError(f"model '{spec.name}': unknown output '{output.name}' requested; "
                                       f"expected one of: {', '.join(known)}")
        if output.name in seen:
            raise InvalidArgumentError(f"model '{spec.name}': output '{output.name}' is requested more than once")
        seen.add(output.name)
        if output.classification < 0:
            raise InvalidArgumentError(f"model '{spec.name}': output '{output.name}' asks for classification "
                                       f"{output.classification}; expected a positive class count")


def _batch_size(spec: ModelSpec, request: InferRequest) -> int:
    if not spec.batching:
        return 1
    if len(request.inputs) == 1:
        return request.inputs[0].shape[0]
    sizes = {tensor.name: tensor.shape[0] for tensor in request.inputs}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{name}={size}" for name, size in sizes.items())
        raise InvalidArgumentError(f"model '{spec.name}': inputs disagree on the batch size ({listed}); "
                                   f"every input needs the same first dimension")
    return next(iter(sizes.values()), 1)


def check_reserved_parameters(model: str, parameters: Mapping[str, object]) -> None:
    """``priority`` and ``timeout`` are unsigned 64-bit integers, ``sequence_id`` one or a string and
    ``sequence_start`` / ``sequence_end`` booleans, for every model: one that ignores them (no dynamic batching, no
    sequences) still refuses a value no model could take."""
    for key, meaning in _UNSIGNED_PARAMETERS.items():
        if key in parameters and not _is_uint64(value := parameters[key]):
            raise InvalidArgumentError(f"model '{model}': request parameter '{key}' is {value!r}; expected an "
                                       f"integer 0..{_UINT64_MAX} ({meaning})")
    if "sequence_id" in parameters and not (isinstance(value := parameters["sequence_id"], str)
                                            or _is_uint64(value)):
        raise InvalidArgumentError(f"model '{model}': request parameter 'sequence_id' is {value!r}; expected an "
                                   f"integer 0..{_UINT64_MAX} or a string")
    for key in ("sequence_start", "sequence_end"):
        if key in parameters and not isinstance(value := parameters[key], bool):
            raise InvalidArgumentError(f"model '{model}': request parameter '{key}' is {value!r}; expected true "
                                       f"or false")


def _is_uint64(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _UINT64_MAX
