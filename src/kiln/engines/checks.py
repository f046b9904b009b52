"""Check direct-call inputs against a model's spec: names, data types, shapes and the batch dimension."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.config.spec import ModelSpec, TensorSpec
from kiln.errors import InvalidArgumentError
from kiln.tensor import DataType


def check_inputs(spec: ModelSpec, inputs: Mapping[str, npt.ArrayLike], *,
                 keep_torch_tensors: bool = False) -> dict[str, npt.NDArray[Any]]:
    """Checked inputs as numpy arrays; torch tensors stay tensors (on their device) when ``keep_torch_tensors``."""
    expected = spec.input_map
    unknown = [name for name in inputs if name not in expected]
    if unknown:
        raise InvalidArgumentError(f"model '{spec.name}': unexpected input '{unknown[0]}'; "
                                   f"expected inputs: {', '.join(expected)}")
    # With no unknown names, as many inputs as the model has means none is missing.
    missing = [] if len(inputs) == len(expected) else [
        t.name for t in spec.inputs if t.name not in inputs and not t.optional]
    if missing:
        raise InvalidArgumentError(f"model '{spec.name}': missing input '{missing[0]}' "
                                   f"({_describe(spec, expected[missing[0]])})")
    arrays = {name: _check_torch_tensor(spec, expected[name], value) if keep_torch_tensors and _is_torch(value)
              else _check_array(spec, expected[name], value) for name, value in inputs.items()}
    if spec.batching and len(arrays) > 1:
        _check_same_batch(spec, arrays)
    return arrays


def check_outputs(spec: ModelSpec, outputs: Sequence[str] | None) -> list[str]:
    if outputs is None:
        return [t.name for t in spec.outputs]
    known = {t.name for t in spec.outputs}
    for name in outputs:
        if name not in known:
            raise InvalidArgumentError(f"model '{spec.name}': unknown output '{name}'; "
                                       f"expected one of: {', '.join(t.name for t in spec.outputs)}")
    return list(outputs)


def check_shape(spec: ModelSpec, tensor: TensorSpec, shape: Sequence[int]) -> None:
    """Raise unless ``shape`` (with the batch dimension when batching) fits the tensor's dims."""
    dims = tuple(shape)
    want = spec.request_shapes.get(tensor.name) or spec.request_shape(tensor)
    if (spec.batching and len(dims) == len(want) and dims[1:] == want[1:] and -1 not in dims
            and 1 <= dims[0] <= spec.max_batch_size):  # the common case: fixed dims and a batch size in range
        return
    ok = len(dims) == len(want) and all(w == -1 or w == d for w, d in zip(want, dims, strict=True))
    if ok and spec.batching and not 1 <= dims[0] <= spec.max_batch_size:
        raise InvalidArgumentError(
            f"model '{spec.name}': input '{tensor.name}' has batch size {dims[0]}; "
            f"expected 1..{spec.max_batch_size} (max_batch_size)"
        )
    if not ok or any(d < 0 for d in dims):
        raise InvalidArgumentError(f"model '{spec.name}': input '{tensor.name}' has shape {list(dims)}; "
                                   f"expected {_describe(spec, tensor)}")


def _check_array(spec: ModelSpec, tensor: TensorSpec, value: npt.ArrayLike) -> npt.NDArray[Any]:
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as exc:  # ragged lists, device tensors numpy cannot read, ...
        raise InvalidArgumentError(f"model '{spec.name}': input '{tensor.name}' cannot be read as an array "
                                   f"({type(value).__name__}: {exc}); pass a numpy array") from None
    if tensor.datatype is DataType.BYTES:
        if array.dtype.kind not in ("O", "S", "U"):
            raise InvalidArgumentError(f"model '{spec.name}': input '{tensor.name}' has dtype {array.dtype}; "
                                       f"expected BYTES (numpy object, bytes or str)")
    elif array.dtype != tensor.datatype.numpy_dtype:
        raise InvalidArgumentError(
            f"model '{spec.name}': input '{tensor.name}' has dtype {array.dtype}; expected "
            f"{tensor.datatype.wire_name} (numpy {tensor.datatype.numpy_dtype}); convert with .astype()"
        )
    check_shape(spec, tensor, array.shape)
    return array


def _is_torch(value: object) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "device")


def _check_torch_tensor(spec: ModelSpec, tensor: TensorSpec, value: Any) -> Any:
    """A torch tensor checked like an array (dtype by name, shape), left where it is: a GPU input costs no copy."""
    dtype = str(value.dtype).removeprefix("torch.")
    if tensor.datatype is DataType.BYTES or dtype != tensor.datatype.numpy_dtype.name:
        raise InvalidArgumentError(
            f"model '{spec.name}': input '{tensor.name}' is a torch tensor of dtype {value.dtype}; expected "
            f"{tensor.datatype.wire_name} (torch.{tensor.datatype.numpy_dtype.name})")
    check_shape(spec, tensor, tuple(value.shape))
    return value


def _check_same_batch(spec: ModelSpec, arrays: Mapping[str, npt.NDArray[Any]]) -> None:
    sizes = {name: array.shape[0] for name, array in arrays.items()}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{name}={size}" for name, size in sizes.items())
        raise InvalidArgumentError(f"model '{spec.name}': inputs disagree on the batch size ({listed}); "
                                   f"every input needs the same first dimension")


def _describe(spec: ModelSpec, tensor: TensorSpec) -> str:
    shape = list(spec.request_shape(tensor))
    batch = f", first dim = batch size 1..{spec.max_batch_size}" if spec.batching else ""
    return f"{tensor.datatype.wire_name} with shape {shape}{batch}, -1 = any size"
