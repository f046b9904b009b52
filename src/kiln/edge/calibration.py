"""Statistics of the inputs a model was calibrated on, for the edge's out-of-range checks.

The samples file is an ``.npz`` with one array per input, samples along the first axis (``[samples, *dims]``, as
``kiln build --calibration-data`` reads it). The statistics file is an ``.npz`` too: for each input ``<name>``,
per-feature ``<name>.mean``, ``<name>.std``, ``<name>.min`` and ``<name>.max`` over the flattened features.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.errors import ConfigError

Array = npt.NDArray[Any]
_FIELDS = ("mean", "std", "min", "max")
_MIN_STD = 1e-6  # a constant feature still gets a finite z-score


@dataclass(frozen=True)
class InputStats:
    mean: Array
    std: Array
    minimum: Array
    maximum: Array


@dataclass(frozen=True)
class CalibrationStats:
    inputs: Mapping[str, InputStats]


def compute_calibration(samples: Mapping[str, npt.ArrayLike]) -> CalibrationStats:
    stats: dict[str, InputStats] = {}
    for name, value in samples.items():
        array = np.asarray(value, dtype=np.float64)
        if array.ndim == 0 or array.shape[0] < 2:
            raise ConfigError(f"calibration samples of '{name}' have shape {list(array.shape)}; expected at least "
                              f"2 samples along the first axis")
        rows = array.reshape(array.shape[0], -1)
        stats[name] = InputStats(rows.mean(axis=0), np.maximum(rows.std(axis=0), _MIN_STD), rows.min(axis=0),
                                 rows.max(axis=0))
    if not stats:
        raise ConfigError("calibration samples hold no arrays")
    return CalibrationStats(stats)


def write_calibration(samples_path: Path, stats_path: Path) -> CalibrationStats:
    """Read samples from ``samples_path`` and write their statistics to ``stats_path``."""
    try:
        with np.load(samples_path, allow_pickle=False) as data:
            samples = {name: data[name] for name in data.files}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"calibration samples {samples_path}: {exc}") from None
    stats = compute_calibration(samples)
    arrays = {f"{name}.{key}": value for name, s in stats.inputs.items()
              for key, value in zip(_FIELDS, (s.mean, s.std, s.minimum, s.maximum), strict=True)}
    save: Any = np.savez  # numpy's stubs mistake array keywords for its allow_pickle flag
    with open(stats_path, "wb") as out:
        save(out, **arrays)
    return stats


def load_calibration(path: Path) -> CalibrationStats:
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"calibration statistics {path}: {exc}") from None
    names = sorted({key.rpartition(".")[0] for key in arrays})
    stats: dict[str, InputStats] = {}
    for name in names:
        missing = [f for f in _FIELDS if f"{name}.{f}" not in arrays]
        if missing or not name:
            raise ConfigError(f"calibration statistics {path}: input '{name}' lacks {', '.join(missing) or 'a name'}"
                              f"; expected <input>.mean, .std, .min and .max arrays")
        mean, std, low, high = (arrays[f"{name}.{f}"].astype(np.float64).reshape(-1) for f in _FIELDS)
        stats[name] = InputStats(mean, np.maximum(std, _MIN_STD), low, high)
    if not stats:
        raise ConfigError(f"calibration statistics {path}: the file holds no arrays")
    return CalibrationStats(stats)
