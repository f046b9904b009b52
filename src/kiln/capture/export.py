"""The samples a ``kiln serve --capture-dir`` stored, as one npz for retraining.

The npz holds every array name of the samples (``input/<name>``, ``local/<name>``, ``cloud/<name>``) with the
samples' rows concatenated along the first axis. ``<output>.json`` lists the samples in the same order: id,
version, time, reason, source, edge, and for each array the rows ``[start, stop)`` it occupies. A sample lacks an
array (e.g. ``cloud/...`` when the cloud gave no answer) when that array name is absent from its ``rows``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.errors import InvalidArgumentError, NotFoundError
from kiln.server.capture import REPLICA_STORE_PREFIX, live_samples

Array = npt.NDArray[Any]


def replica_stores(capture_dir: Path) -> list[Path]:
    return sorted(p for p in capture_dir.glob(f"{REPLICA_STORE_PREFIX}*") if p.is_dir())


def index_path(output: Path) -> Path:
    return output.with_suffix(".json")


def export_samples(capture_dir: Path, model: str, version: str | None, output: Path) -> list[dict[str, Any]]:
    """Write ``output`` (npz) and its JSON index; returns the index. ``capture_dir`` is one server's store, or
    the folder of a cluster's replicas' stores (``replica-*``, docs/cluster.md): their samples are merged by time,
    a sample id stored by two replicas (an edge's retry) once."""
    stores = replica_stores(Path(capture_dir)) or [Path(capture_dir)]
    folders = [store / model for store in stores if (store / model).is_dir()]
    if not folders:
        raise NotFoundError(f"capture export: no samples of model '{model}' under '{capture_dir}'")
    versions = [version] if version is not None else sorted(
        {p.name for folder in folders for p in folder.iterdir() if p.is_dir() and p.name.isdigit()}, key=int)
    if version is not None and not any((folder / version).is_dir() for folder in folders):
        raise NotFoundError(f"capture export: no samples of model '{model}' version {version} under "
                            f"'{capture_dir}'")
    parts: dict[str, list[Array]] = {}
    rows: dict[str, int] = {}
    index: list[dict[str, Any]] = []
    for v in versions:
        entries = sorted(((entry["time"], n, folder / v, entry) for n, folder in enumerate(folders)
                          if (folder / v).is_dir() for entry in live_samples(folder / v)), key=lambda e: e[:2])
        seen: set[str] = set()
        for _, _, where, entry in entries:
            if entry["id"] in seen:
                continue
            seen.add(entry["id"])
            with np.load(where / entry["file"], allow_pickle=False) as npz:
                arrays = {name: npz[name] for name in npz.files}
            spans = {}
            for name, array in arrays.items():
                _check_compatible(model, name, parts.get(name), array, entry["id"])
                start = rows.get(name, 0)
                parts.setdefault(name, []).append(array)
                rows[name] = start + len(array)
                spans[name] = [start, rows[name]]
            index.append({"id": entry["id"], "version": v, "time": entry["time"], "reason": entry["reason"],
                          "source": entry.get("source", ""), "edge": entry.get("edge", ""), "rows": spans})
    output.parent.mkdir(parents=True, exist_ok=True)
    save: Any = np.savez  # numpy's stubs mistake array keywords for its allow_pickle flag
    with output.open("wb") as f:
        save(f, **{name: np.concatenate(arrays) for name, arrays in parts.items()})
    index_path(output).write_text(json.dumps({"model": model, "samples": index}, indent=1) + "\n")
    return index


def _check_compatible(model: str, name: str, earlier: list[Array] | None, array: Array, sample_id: str) -> None:
    if array.ndim == 0:
        raise InvalidArgumentError(f"capture export of model '{model}': array '{name}' of sample '{sample_id}' is "
                                   f"a scalar; samples need a first (batch) axis to be concatenated")
    if earlier and (earlier[0].shape[1:] != array.shape[1:] or earlier[0].dtype != array.dtype):
        raise InvalidArgumentError(f"capture export of model '{model}': array '{name}' of sample '{sample_id}' is "
                                   f"{array.dtype}{list(array.shape)}, unlike the earlier samples' "
                                   f"{earlier[0].dtype}{list(earlier[0].shape)}; export one version at a time "
                                   f"(--version)")
