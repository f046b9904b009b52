"""Device tensors at the direct API: what ``Engine.infer`` does with DLPack-capable inputs, and what it returns.

The rule (docs/pytorch-backend.md, "Device tensors"):

- numpy arrays and other host data: unchanged; outputs are numpy.
- Host (CPU) DLPack objects (a CPU torch tensor for an engine that does not take torch tensors, a CPU JAX array,
  ...) become numpy through ``np.from_dlpack``: a view, no copy. Outputs are numpy.
- Device (CUDA) DLPack objects (torch CUDA tensors, cupy arrays, ...) go to an engine that takes torch tensors
  (the PyTorch backend) as torch views of the same memory (``torch.from_dlpack``: no copy); any other engine gets
  a host copy, since it computes on the host. The outputs then come back as the same kind as the first device
  input (torch tensors, or the input library's ``from_dlpack`` of them) on that input's device: device tensors in,
  device tensors out. An engine that already returns device tensors costs no copy; one that returns numpy has its
  outputs copied to the device once.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.errors import InvalidArgumentError

_DL_CPU = 1
"""``kDLCPU`` in ``__dlpack_device__()``; every other device type holds its data off the host."""


@dataclass(frozen=True)
class DeviceInputs:
    """The first device input (its type decides the outputs' kind) and its torch device."""

    like: object
    device: Any


def prepare_inputs(model: str, inputs: Mapping[str, Any], keep_torch: bool) -> tuple[dict[str, Any],
                                                                                    DeviceInputs | None]:
    """Inputs an engine can check and run (see the module rule), and the device inputs' kind (None: host only)."""
    prepared: dict[str, Any] = {}
    device: DeviceInputs | None = None
    for name, value in inputs.items():
        where = _dlpack_device(value)
        if where is None:
            prepared[name] = value
        elif where == _DL_CPU:
            prepared[name] = value if keep_torch and _is_torch(value) else _from_dlpack(model, name, value)
        else:
            tensor = _as_torch(model, name, value)
            device = device or DeviceInputs(value, tensor.device)
            prepared[name] = tensor if keep_torch else _host_copy(model, name, tensor)
    return prepared, device


def outputs_like(outputs: Mapping[str, Any], device: DeviceInputs | None) -> dict[str, Any]:
    """The engine's outputs, as the kind of the device inputs on their device (unchanged for host inputs)."""
    if device is None:
        return dict(outputs)
    import torch

    converted: dict[str, Any] = {}
    for name, value in outputs.items():
        if not isinstance(value, torch.Tensor):
            if isinstance(value, np.ndarray) and value.dtype == object:
                converted[name] = value  # BYTES: no device has string tensors
                continue
            value = _torch_from_numpy(np.ascontiguousarray(value)).to(device.device)
        converted[name] = _like(value, device.like)
    return converted


def _dlpack_device(value: object) -> int | None:
    if isinstance(value, np.ndarray) or not hasattr(value, "__dlpack__"):
        return None
    try:
        return int(value.__dlpack_device__()[0])  # type: ignore[attr-defined]  # checked: a DLPack producer
    except (AttributeError, TypeError, ValueError, IndexError):
        return None


def _is_torch(value: object) -> bool:
    return type(value).__module__.startswith("torch")


def _from_dlpack(model: str, name: str, value: Any) -> Any:
    try:
        return np.from_dlpack(value)
    except (TypeError, RuntimeError, BufferError, ValueError) as exc:
        raise InvalidArgumentError(f"model '{model}': input '{name}' ({type(value).__name__}) cannot be read "
                                   f"through DLPack: {exc}; pass a numpy array") from None


def _as_torch(model: str, name: str, value: Any) -> Any:
    try:
        import torch
    except ImportError:
        raise InvalidArgumentError(f"model '{model}': input '{name}' is a device array ({type(value).__name__}); "
                                   f"kiln takes device arrays through PyTorch, which is not installed; copy it "
                                   f"to the host (numpy) first") from None
    if isinstance(value, torch.Tensor):
        return value
    from torch.utils.dlpack import from_dlpack

    try:
        return from_dlpack(value)
    except (TypeError, RuntimeError, BufferError, ValueError) as exc:
        raise InvalidArgumentError(f"model '{model}': input '{name}' ({type(value).__name__}) cannot be read "
                                   f"through DLPack: {exc}") from None


def _host_copy(model: str, name: str, tensor: Any) -> Any:
    try:
        return tensor.detach().cpu().numpy()
    except (TypeError, RuntimeError) as exc:
        raise InvalidArgumentError(f"model '{model}': input '{name}' (a {tensor.dtype} device tensor) cannot be "
                                   f"copied to a numpy array for this host-side engine: {exc}") from None


def _torch_from_numpy(array: np.ndarray) -> Any:
    import torch

    if array.dtype.name == "bfloat16":  # ml_dtypes' bfloat16 shares torch.bfloat16's bits
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _like(tensor: Any, like: object) -> Any:
    """``tensor`` as the type of ``like``: torch stays torch; others through their library's ``from_dlpack``."""
    if _is_torch(like):
        return tensor
    library = importlib.import_module(type(like).__module__.split(".")[0])
    from_dlpack = getattr(library, "from_dlpack", None)
    return from_dlpack(tensor) if from_dlpack is not None else tensor
