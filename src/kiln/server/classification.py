"""The classification extension: replace an output tensor by its top-k "value:index[:label]" strings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.errors import InvalidArgumentError


def read_labels(path: Path) -> list[str]:
    """One label per line, as Triton's label_filename files hold them."""
    return path.read_text(encoding="utf-8").splitlines()


def classify(model: str, output: str, data: npt.NDArray[Any], k: int, batching: bool,
             labels: list[str]) -> npt.NDArray[np.object_]:
    """Top-k of each batch row (or of the whole tensor without batching), highest first."""
    if data.dtype.kind not in ("f", "i", "u", "b"):
        raise InvalidArgumentError(f"model '{model}': classification needs a numeric output, but '{output}' "
                                   f"is {data.dtype}")
    rows = data.reshape(data.shape[0], -1) if batching and data.ndim > 0 else data.reshape(1, -1)
    k = min(k, rows.shape[1])
    result = np.empty((rows.shape[0], k), dtype=object)
    for r, row in enumerate(rows):
        order = np.argsort(-row.astype(np.float64), kind="stable")[:k]
        for c, index in enumerate(order):
            text = f"{_number(row[index])}:{int(index)}"
            if int(index) < len(labels):
                text += f":{labels[int(index)]}"
            result[r, c] = text.encode("utf-8")
    return result if batching else result.reshape(k)


def _number(value: Any) -> str:
    """Formatted as C++ std::to_string does (Triton builds the strings with it): six decimals for floats."""
    if isinstance(value, (np.floating, float)):
        return f"{float(value):f}"
    return str(int(value))
