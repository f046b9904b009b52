"""numpy <-> torch at the engine boundary: dtype mapping, zero-copy views on the CPU, pinned copies to the GPU."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import torch

from kiln.config.spec import ModelSpec, TensorSpec
from kiln.errors import InternalError, UnsupportedError
from kiln.tensor import DataType

_TORCH_DTYPES: dict[DataType, torch.dtype] = {
    DataType.BOOL: torch.bool,
    DataType.UINT8: torch.uint8,
    DataType.UINT16: torch.uint16,
    DataType.UINT32: torch.uint32,
    DataType.UINT64: torch.uint64,
    DataType.INT8: torch.int8,
    DataType.INT16: torch.int16,
    DataType.INT32: torch.int32,
    DataType.INT64: torch.int64,
    DataType.FP16: torch.float16,
    DataType.FP32: torch.float32,
    DataType.FP64: torch.float64,
    DataType.BF16: torch.bfloat16,
}
_BF16 = np.dtype(ml_dtypes.bfloat16)


def torch_dtype(spec: ModelSpec, tensor: TensorSpec, kind: str) -> torch.dtype:
    """The torch dtype of a config tensor; BYTES has none (PyTorch has no string tensors)."""
    dtype = _TORCH_DTYPES.get(tensor.datatype)
    if dtype is None:
        raise UnsupportedError(f"model '{spec.name}': {kind} '{tensor.name}' is {tensor.datatype.config_name}, "
                               f"which kiln's PyTorch backend does not support (PyTorch has no string tensors); "
                               f"use a numeric type, or serve the model through the python or onnxruntime backend")
    return dtype


def host_tensor(array: npt.NDArray[Any]) -> torch.Tensor:
    """A CPU tensor over ``array``'s memory. Read-only arrays (views over received bytes) are copied first:
    torch tensors are always writable, and a model that writes into its input must not reach the request's bytes."""
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array, order="C", copy=True)
    if array.dtype == _BF16:
        # numpy has no native bfloat16: reinterpret the 16-bit patterns, which torch.bfloat16 shares.
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device`` through pinned memory so the copy runs asynchronously on the stream."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def to_numpy(spec: ModelSpec, tensor_spec: TensorSpec, value: object, target: torch.dtype) -> npt.NDArray[Any]:
    """A model output as a numpy array of the config's dtype. Floating outputs are cast (the engine may compute in
    fp16/bf16); any other mismatch is the model disagreeing with its config."""
    value = checked_output(spec, tensor_spec, value, target)
    if value.dtype != target:
        value = value.to(target)
    value = value.detach().to("cpu").contiguous()
    if target == torch.bfloat16:
        return value.view(torch.int16).numpy().view(_BF16)
    return value.numpy()


def checked_output(spec: ModelSpec, tensor_spec: TensorSpec, value: object, target: torch.dtype) -> torch.Tensor:
    """``value`` if it is a tensor the config's dtype can take (a floating output may differ in width)."""
    if not isinstance(value, torch.Tensor):
        raise InternalError(f"model '{spec.name}': output '{tensor_spec.name}' is a {type(value).__name__}, not a "
                            f"tensor; the model must return tensors")
    if value.dtype != target and not (value.is_floating_point() and target.is_floating_point):
        raise InternalError(f"model '{spec.name}': output '{tensor_spec.name}' has dtype {value.dtype}, but the "
                            f"config declares {tensor_spec.datatype.config_name}; make the config's data_type "
                            f"match what the model returns")
    return value
