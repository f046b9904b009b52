"""What a build starts from: an ONNX file, or a PyTorch module with example inputs (torch backend only).

A source knows its tensors (for the config and for generated samples) and gives the FP32 reference engine that
verification compares the build against.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.build.output import make_config
from kiln.config.onnx_io import FileIO, FileTensor, read_onnx_io
from kiln.config.validate import validate_config
from kiln.direct import load
from kiln.engines.base import Array, Engine
from kiln.errors import InvalidArgumentError
from kiln.tensor import DataType

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class OnnxSource:
    path: Path

    @property
    def description(self) -> str:
        return str(self.path)

    def file_io(self) -> FileIO:
        return read_onnx_io(self.path)

    def reference(self) -> Engine:
        return load(self.path)


class ModuleSource:
    """A torch module given in Python. Inputs are named after ``forward``'s parameters, outputs ``output__<i>``
    (dict outputs keep their keys); the first dimension of every tensor is the batch dimension."""

    def __init__(self, module: torch.nn.Module, example_inputs: Sequence[Any] | Any) -> None:
        import torch

        examples = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        if not examples or not all(isinstance(t, torch.Tensor) for t in examples):
            raise InvalidArgumentError("example_inputs must be a tensor or a tuple of tensors, one per forward() "
                                       "argument, with the batch dimension first")
        self.module = module.eval()
        self.examples: tuple[torch.Tensor, ...] = examples
        self.input_names = _input_names(module, len(examples))
        with torch.no_grad():
            outputs = module(*examples)
        self.output_names, output_tensors = _outputs(outputs)
        self._io = FileIO(
            inputs=tuple(_file_tensor(n, t) for n, t in zip(self.input_names, examples, strict=True)),
            outputs=tuple(_file_tensor(n, t) for n, t in zip(self.output_names, output_tensors, strict=True)))

    @property
    def description(self) -> str:
        return f"torch module {type(self.module).__name__}"

    def file_io(self) -> FileIO:
        return self._io

    def reference(self) -> Engine:
        config = make_config("reference", "pytorch", "", self._io, 0, gpu=False, parameters={})
        spec = validate_config(config, "reference", self.description, None)
        return _EagerModule(spec, self)


class _EagerModule(Engine):
    """The module as given, in FP32 eager mode: the reference a build is verified against."""

    def __init__(self, spec: Any, source: ModuleSource) -> None:
        super().__init__(spec)
        self._source = source

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        import torch

        device = next((p.device for p in self._source.module.parameters()), torch.device("cpu"))
        args = [torch.from_numpy(np.ascontiguousarray(inputs[n])).to(device) for n in self._source.input_names]
        with torch.no_grad():
            names, values = _outputs(self._source.module(*args))
        by_name = dict(zip(names, values, strict=True))
        return {name: by_name[name].detach().float().cpu().numpy() if by_name[name].is_floating_point()
                else by_name[name].detach().cpu().numpy() for name in outputs}


def _input_names(module: torch.nn.Module, count: int) -> tuple[str, ...]:
    parameters = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(parameters) >= count:
        return tuple(p.name for p in parameters[:count])
    return tuple(f"input__{i}" for i in range(count))


def _outputs(result: Any) -> tuple[tuple[str, ...], tuple[torch.Tensor, ...]]:
    import torch

    if isinstance(result, torch.Tensor):
        return ("output__0",), (result,)
    if isinstance(result, Mapping):
        return tuple(str(k) for k in result), tuple(result.values())
    if isinstance(result, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in result):
        return tuple(f"output__{i}" for i in range(len(result))), tuple(result)
    raise InvalidArgumentError(f"the module returns {type(result).__name__}; kiln builds modules that return a "
                               f"tensor, a tuple of tensors or a dict of tensors")


def _file_tensor(name: str, tensor: torch.Tensor) -> FileTensor:
    import torch

    dtype = {torch.float32: DataType.FP32, torch.float16: DataType.FP16, torch.bfloat16: DataType.BF16,
             torch.float64: DataType.FP64, torch.int64: DataType.INT64, torch.int32: DataType.INT32,
             torch.int8: DataType.INT8, torch.uint8: DataType.UINT8, torch.bool: DataType.BOOL}.get(tensor.dtype)
    if dtype is None:
        raise InvalidArgumentError(f"tensor '{name}' has dtype {tensor.dtype}, which kiln cannot serve")
    if tensor.dim() == 0:
        raise InvalidArgumentError(f"tensor '{name}' is a scalar; kiln needs a batch dimension first")
    return FileTensor(name, dtype, (-1, *tensor.shape[1:]))
