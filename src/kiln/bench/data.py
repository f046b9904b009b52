"""Request inputs from the model's metadata: random or zero tensors, or samples from a file.

``--shape NAME:d1,d2`` fills an input's dynamic dimensions (batch dimension excluded, as perf_analyzer has it);
``--batch-size`` stacks that many samples into each request of a batching model. Random and zero data is built
once and every request reuses it (perf_analyzer does the same). A file gives samples that requests take in turn:

* ``.npz``: one array per input, samples along the first axis (``[samples, *dims]``);
* ``.json``: perf_analyzer's ``--input-data`` format, ``{"data": [{"INPUT0": [...], ...}, ...]}``, one entry per
  sample; a value is a flat row-major list, ``{"b64": ...}`` (little-endian bytes; BYTES length-prefixed), or
  ``{"content": ..., "shape": [...]}``. Sequence streams (a list of lists) are not supported.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.errors import InvalidArgumentError, UnsupportedError
from kiln.tensor import DataType, decode_bytes, element_count
from kiln.v2.types import TensorMeta

Array = npt.NDArray[Any]
Request = dict[str, Array]
"""Input name -> the full tensor one request sends (batch dimension included for batching models)."""
Sample = dict[str, Array]


@dataclass(frozen=True)
class ModelInputs:
    """What the bench needs to know of a model: its inputs as a request sees them (dims without the batch
    dimension) and its max_batch_size (0: no batching)."""

    name: str
    inputs: tuple[TensorMeta, ...]
    max_batch_size: int = 0

    @property
    def batching(self) -> bool:
        return self.max_batch_size > 0


def build_requests(model: ModelInputs, input_data: str, batch_size: int, shapes: Mapping[str, tuple[int, ...]],
                   seed: int = 0) -> list[Request]:
    """The distinct requests a run cycles through (one for random and zero data)."""
    _check_batch(model, batch_size)
    _check_shape_names(model, shapes)
    if input_data in ("random", "zero"):
        sample = {t.name: _generated(t, sample_shape(model.name, t, shapes), input_data, seed + i)
                  for i, t in enumerate(model.inputs)}
        return [_batch(model, [sample] * batch_size)]
    path = Path(input_data)
    if not path.is_file():
        raise InvalidArgumentError(f"--input-data is '{input_data}'; expected random, zero, or a .npz or .json file")
    if path.suffix == ".npz":
        samples = _npz_samples(model, path)
    elif path.suffix == ".json":
        samples = _json_samples(model, path, shapes)
    else:
        raise UnsupportedError(f"--input-data {path}: kiln bench reads .npz (one array per input, samples first) "
                               f"or perf_analyzer's .json format")
    return _requests_from_samples(model, samples, batch_size)


def sample_shape(model: str, tensor: TensorMeta, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    """One sample's shape: the model's dims, with -1 taken from ``--shape``."""
    given = shapes.get(tensor.name)
    if given is None:
        if -1 in tensor.dims:
            example = ",".join("1" if d == -1 else str(d) for d in tensor.dims)
            raise InvalidArgumentError(f"model '{model}': input '{tensor.name}' has dynamic dimensions "
                                       f"{list(tensor.dims)}; give its shape with --shape {tensor.name}:{example}")
        return tensor.dims
    fits = len(given) == len(tensor.dims) and all(d in (-1, g) for d, g in zip(tensor.dims, given, strict=True))
    if not fits:
        raise InvalidArgumentError(f"model '{model}': --shape {tensor.name}:{','.join(map(str, given))} does not "
                                   f"fit the input's dims {list(tensor.dims)} (batch dimension excluded; -1 = any)")
    return given


def _check_batch(model: ModelInputs, batch_size: int) -> None:
    if not model.batching and batch_size != 1:
        raise InvalidArgumentError(f"model '{model.name}' does not batch (max_batch_size 0); -b/--batch-size must "
                                   f"be 1, got {batch_size}")
    if model.batching and batch_size > model.max_batch_size:
        raise InvalidArgumentError(f"model '{model.name}': -b/--batch-size {batch_size} exceeds its "
                                   f"max_batch_size {model.max_batch_size}")


def _check_shape_names(model: ModelInputs, shapes: Mapping[str, tuple[int, ...]]) -> None:
    names = {t.name for t in model.inputs}
    unknown = sorted(set(shapes) - names)
    if unknown:
        raise InvalidArgumentError(f"model '{model.name}' has no input {', '.join(unknown)} (--shape); its inputs: "
                                   f"{', '.join(sorted(names))}")


def _generated(tensor: TensorMeta, shape: tuple[int, ...], kind: str, seed: int) -> Array:
    dtype = tensor.datatype.numpy_dtype
    if kind == "zero":
        if tensor.datatype is DataType.BYTES:
            return _object_array([b"0"] * element_count(shape), shape)
        return np.zeros(shape, dtype=dtype)
    rng = np.random.default_rng(seed)
    if tensor.datatype is DataType.BYTES:  # decimal strings: what text models that parse numbers accept
        return _object_array([str(v).encode() for v in rng.integers(0, 100, element_count(shape))], shape)
    if tensor.datatype is DataType.BOOL:
        return rng.integers(0, 2, shape).astype(bool)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 64, shape).astype(dtype)
    return rng.random(shape, dtype=np.float32).astype(dtype)


def _object_array(values: Sequence[bytes], shape: tuple[int, ...]) -> Array:
    array = np.empty(len(values), dtype=object)
    array[:] = list(values)
    return array.reshape(shape)


def _batch(model: ModelInputs, samples: Sequence[Sample]) -> Request:
    if not model.batching:
        return dict(samples[0])
    request: Request = {}
    for tensor in model.inputs:
        if tensor.name not in samples[0]:
            continue  # an optional input the data leaves out
        parts = [s[tensor.name] for s in samples]
        if len({p.shape for p in parts}) != 1:
            raise InvalidArgumentError(f"model '{model.name}': input '{tensor.name}': samples batched into one "
                                       f"request have different shapes {sorted({p.shape for p in parts})}")
        request[tensor.name] = np.stack(parts)
    return request


def _requests_from_samples(model: ModelInputs, samples: list[Sample], batch_size: int) -> list[Request]:
    """Request i takes samples i*b .. i*b+b-1, wrapping around, until every sample was sent once."""
    if not samples:
        raise InvalidArgumentError(f"model '{model.name}': the input data holds no samples")
    count = -(-len(samples) // batch_size)
    return [_batch(model, [samples[(i * batch_size + j) % len(samples)] for j in range(batch_size)])
            for i in range(count)]


def _npz_samples(model: ModelInputs, path: Path) -> list[Sample]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"--input-data {path}: cannot read it as .npz ({exc})") from None
    required = [t for t in model.inputs if not t.optional or t.name in arrays]
    missing = [t.name for t in required if t.name not in arrays]
    if missing:
        raise InvalidArgumentError(f"--input-data {path}: no array for input(s) {', '.join(missing)} of model "
                                   f"'{model.name}'; the file holds {', '.join(sorted(arrays)) or 'nothing'}")
    counts = {t.name: len(arrays[t.name]) if arrays[t.name].ndim else 0 for t in required}
    if len(set(counts.values())) != 1:
        raise InvalidArgumentError(f"--input-data {path}: inputs hold different sample counts "
                                   f"({', '.join(f'{n}: {c}' for n, c in counts.items())})")
    for tensor in required:
        array = arrays[tensor.name]
        fits = array.ndim == len(tensor.dims) + 1 and all(
            d in (-1, a) for d, a in zip(tensor.dims, array.shape[1:], strict=True))
        if not fits:
            raise InvalidArgumentError(f"--input-data {path}: input '{tensor.name}' has shape {list(array.shape)}; "
                                       f"expected [samples, {', '.join(map(str, tensor.dims))}] (-1 = any)")
    converted = {t.name: _as_dtype(arrays[t.name], t.datatype) for t in required}
    return [{name: array[i] for name, array in converted.items()} for i in range(next(iter(counts.values())))]


def _as_dtype(array: Array, datatype: DataType) -> Array:
    if datatype is DataType.BYTES:
        flat = [v if isinstance(v, bytes) else str(v).encode() for v in array.reshape(-1).tolist()]
        return _object_array(flat, array.shape)
    return array.astype(datatype.numpy_dtype, copy=False)


def _json_samples(model: ModelInputs, path: Path, shapes: Mapping[str, tuple[int, ...]]) -> list[Sample]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"--input-data {path}: cannot read it as JSON ({exc})") from None
    entries = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise InvalidArgumentError(f"--input-data {path}: expected {{\"data\": [{{input name: values}}, ...]}} with "
                                   f"at least one entry")
    if any(isinstance(entry, list) for entry in entries):
        raise UnsupportedError(f"--input-data {path}: sequence data streams (a list of lists) are not supported")
    return [_json_sample(model, path, index, entry, shapes) for index, entry in enumerate(entries)]


def _json_sample(model: ModelInputs, path: Path, index: int, entry: object,
                 shapes: Mapping[str, tuple[int, ...]]) -> Sample:
    if not isinstance(entry, dict):
        raise InvalidArgumentError(f"--input-data {path}: data[{index}] must be an object of input name -> values")
    sample: Sample = {}
    for tensor in model.inputs:
        if tensor.name not in entry:
            if tensor.optional:
                continue
            raise InvalidArgumentError(f"--input-data {path}: data[{index}] has no value for input '{tensor.name}'")
        where = f"--input-data {path}: data[{index}].{tensor.name}"
        sample[tensor.name] = _json_tensor(model.name, tensor, entry[tensor.name], shapes, where)
    return sample


def _json_tensor(model: str, tensor: TensorMeta, value: object, shapes: Mapping[str, tuple[int, ...]],
                 where: str) -> Array:
    shape: tuple[int, ...] | None = None
    if isinstance(value, dict) and "content" in value:
        given = value.get("shape")
        if not isinstance(given, list) or not all(isinstance(d, int) and d >= 0 for d in given):
            raise InvalidArgumentError(f"{where}: 'shape' must be a list of non-negative integers, got {given!r}")
        shape = sample_shape(model, tensor, {tensor.name: tuple(given)})
        value = value["content"]
    if shape is None:
        shape = sample_shape(model, tensor, shapes)
    if isinstance(value, dict) and isinstance(value.get("b64"), str):
        return _from_b64(tensor, value["b64"], shape, where)
    if not isinstance(value, list):
        raise InvalidArgumentError(f"{where}: expected a list of values, {{\"b64\": ...}} or {{\"content\": ..., "
                                   f"\"shape\": [...]}}, got {type(value).__name__}")
    flat = np.asarray(value, dtype=object).reshape(-1)
    if flat.size != element_count(shape):
        raise InvalidArgumentError(f"{where}: {flat.size} values do not fill shape {list(shape)}")
    if tensor.datatype is DataType.BYTES:
        return _object_array([v.encode() if isinstance(v, str) else bytes(v) for v in flat.tolist()], shape)
    return flat.astype(tensor.datatype.numpy_dtype).reshape(shape)


def _from_b64(tensor: TensorMeta, text: str, shape: tuple[int, ...], where: str) -> Array:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidArgumentError(f"{where}: 'b64' is not valid base64 ({exc})") from None
    count = element_count(shape)
    if tensor.datatype is DataType.BYTES:
        return decode_bytes(raw, count).reshape(shape)
    dtype = tensor.datatype.numpy_dtype
    if len(raw) != count * dtype.itemsize:
        raise InvalidArgumentError(f"{where}: {len(raw)} bytes do not fill shape {list(shape)} of "
                                   f"{tensor.datatype.wire_name} ({count * dtype.itemsize} bytes)")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)
