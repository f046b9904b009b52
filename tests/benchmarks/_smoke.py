"""What the benchmark smoke tests share: the scripts importable by name, their ``main`` run with the smallest
settings, and skips for what a machine lacks (the Debian load generators, torch, a CUDA device)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SRC = BENCHMARKS.parent / "src"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

_PACKAGES = {"wrk": "wrk", "h2load": "nghttp2-client"}


def run_main(script: str, *argv: str) -> int:
    """``benchmarks/<script>.py``'s ``main(argv)`` in this process; its return code. Importing a script puts this
    checkout's src/ on PYTHONPATH for the servers it starts; that is undone afterwards."""
    saved = os.environ.get("PYTHONPATH")
    try:
        rc: int = importlib.import_module(script).main(list(argv))
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    return rc


def read_json(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def needs_tools(*tools: str) -> pytest.MarkDecorator:
    missing = [tool for tool in tools if shutil.which(tool) is None]
    packages = " ".join(_PACKAGES[tool] for tool in missing)
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} on PATH "
                                                    f"(apt-get install {packages}), which CI does not have")


def has_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


needs_torch = pytest.mark.skipif(not has_torch(), reason="needs torch (pip install 'kiln[torch]')")


def cuda_available() -> bool:
    if not has_torch():
        return False
    import torch

    return bool(torch.cuda.is_available())


def numbers_in_column(text: str, column: int, first_cell: str) -> list[float]:
    """The numbers in ``column`` of the Markdown table rows of ``text`` whose first cell is ``first_cell``."""
    values = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_cell:
            values.append(float(cells[column].replace(",", "")))
    return values
