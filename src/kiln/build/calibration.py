"""Inputs for calibration and verification: read from the user's files, or generated from the model's tensors."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from kiln.config.onnx_io import FileTensor
from kiln.engines.base import Array
from kiln.errors import InvalidArgumentError
from kiln.tensor import DataType

Samples = dict[str, Array]
"""Input name -> array whose first dimension counts samples."""


def load_samples(path: Path, inputs: tuple[FileTensor, ...]) -> Samples:
    """Read ``FILE.npz`` (one array per input name, samples along the first axis) or a folder of such files
    (concatenated in name order)."""
    if path.is_dir():
        files = sorted(path.glob("*.npz"))
        if not files:
            raise InvalidArgumentError(f"calibration data {path}: the folder has no .npz files; expected files "
                                       f"holding one array per model input ({_names(inputs)})")
    elif path.is_file():
        files = [path]
    else:
        raise InvalidArgumentError(f"calibration data {path}: no such file or folder")
    parts = [_read_npz(file, inputs) for file in files]
    return {t.name: np.concatenate([part[t.name] for part in parts]) for t in inputs}


def generate_samples(inputs: tuple[FileTensor, ...], count: int, dynamic: Mapping[str, tuple[int, ...]],
                     seed: int) -> Samples:
    """Random samples: standard normal floats, small non-negative integers, random booleans. ``dynamic`` gives a
    full per-sample shape for inputs whose non-batch dimensions are dynamic."""
    rng = np.random.default_rng(seed)
    samples: Samples = {}
    for tensor in inputs:
        shape = (count, *_sample_shape(tensor, dynamic))
        dtype = tensor.datatype.numpy_dtype
        if tensor.datatype is DataType.BYTES:
            raise InvalidArgumentError(f"input '{tensor.name}' is a string tensor; kiln cannot generate samples for "
                                       f"it: pass --calibration-data")
        if tensor.datatype is DataType.BOOL:
            samples[tensor.name] = rng.integers(0, 2, size=shape).astype(bool)
        elif np.issubdtype(dtype, np.integer):
            samples[tensor.name] = rng.integers(0, 10, size=shape).astype(dtype)
        else:
            samples[tensor.name] = rng.standard_normal(shape).astype(dtype)
    return samples


def sample_count(samples: Samples) -> int:
    return len(next(iter(samples.values()))) if samples else 0


def batches(samples: Samples, batch_size: int) -> Iterator[Samples]:
    count = sample_count(samples)
    for start in range(0, count, batch_size):
        yield {name: array[start:start + batch_size] for name, array in samples.items()}


def _read_npz(file: Path, inputs: tuple[FileTensor, ...]) -> Samples:
    try:
        with np.load(file, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"calibration data {file}: cannot read it as .npz ({exc})") from None
    missing = [t.name for t in inputs if t.name not in arrays]
    if missing:
        raise InvalidArgumentError(f"calibration data {file}: no array for input(s) {', '.join(missing)}; "
                                   f"the file holds {', '.join(sorted(arrays)) or 'nothing'}")
    counts = {len(arrays[t.name]) for t in inputs}
    if len(counts) != 1:
        raise InvalidArgumentError(f"calibration data {file}: inputs hold different sample counts "
                                   f"({', '.join(f'{t.name}: {len(arrays[t.name])}' for t in inputs)})")
    samples: Samples = {}
    for tensor in inputs:
        array = arrays[tensor.name]
        expected = tensor.dims[1:]
        fits = array.ndim == len(tensor.dims) and all(
            d in (-1, a) for d, a in zip(expected, array.shape[1:], strict=True))
        if not fits:
            raise InvalidArgumentError(
                f"calibration data {file}: input '{tensor.name}' has shape {list(array.shape)}; expected "
                f"[samples, {', '.join(str(d) for d in expected)}] (-1 = any)")
        samples[tensor.name] = array.astype(tensor.datatype.numpy_dtype, copy=False)
    return samples


def _sample_shape(tensor: FileTensor, dynamic: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    rest = tensor.dims[1:]
    if -1 not in rest:
        return rest
    given = dynamic.get(tensor.name)
    if given is None or len(given) != len(rest):
        raise InvalidArgumentError(
            f"input '{tensor.name}' has dynamic dimensions {list(tensor.dims)}; give its shape with --shapes "
            f"(e.g. {tensor.name}:{'x'.join('1' if d == -1 else str(d) for d in tensor.dims)}) or pass "
            f"--calibration-data")
    return given


def _names(inputs: tuple[FileTensor, ...]) -> str:
    return ", ".join(t.name for t in inputs)
