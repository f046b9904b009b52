"""How a model's versions agree on captured samples (kiln serve's --capture-dir store): each version's answers
(``local/...``) against the reference answers stored with them (``cloud/...``, the store's labels), and versions
against each other on inputs captured for more than one version."""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.errors import InvalidArgumentError, NotFoundError
from kiln.server.capture import live_samples
from kiln.server.shadow import DEFAULT_ATOL, DEFAULT_RTOL, compare_arrays

Arrays = dict[str, npt.NDArray[Any]]


@dataclass
class Agreement:
    """Samples compared, how many agreed within tolerance, and top-1 agreement on class-score outputs."""

    compared: int = 0
    agreed: int = 0
    top1_rows: int = 0
    top1_agreed: int = 0
    max_abs_diff: float = 0.0

    def add(self, reference: Arrays, other: Arrays, atol: float, rtol: float) -> None:
        result = compare_arrays(reference, other, atol, rtol)
        self.compared += 1
        self.agreed += int(result.agreed)
        self.top1_rows += result.top1_rows
        self.top1_agreed += result.top1_agreed
        self.max_abs_diff = max(self.max_abs_diff, result.max_abs_diff)


@dataclass
class CaptureAgreement:
    samples: dict[str, int]  # per version
    against_reference: dict[str, Agreement]  # per version: its local answers against the stored cloud answers
    between_versions: dict[str, Agreement]  # "a:b": the two versions' answers on the same captured inputs
    note: str = ""


def capture_agreement(capture_dir: Path, model: str, atol: float = DEFAULT_ATOL,
                      rtol: float = DEFAULT_RTOL) -> CaptureAgreement:
    folder = Path(capture_dir) / model
    if not folder.is_dir():
        raise NotFoundError(f"ab report: no captured samples of model '{model}' under '{capture_dir}'")
    if atol < 0 or rtol < 0:
        raise InvalidArgumentError(f"ab report: tolerances must be >= 0, got atol={atol} rtol={rtol}")
    versions = sorted((p.name for p in folder.iterdir() if p.is_dir() and p.name.isdigit()), key=int)
    result = CaptureAgreement({}, {}, {})
    by_input: dict[str, dict[str, Arrays]] = {}  # input digest -> version -> its answers
    for version in versions:
        samples = live_samples(folder / version)
        result.samples[version] = len(samples)
        for entry in samples:
            arrays = _load(folder / version / entry["file"])
            local, cloud = _part(arrays, "local"), _part(arrays, "cloud")
            if local and cloud and set(local) & set(cloud):
                shared = sorted(set(local) & set(cloud))
                result.against_reference.setdefault(version, Agreement()).add(
                    {n: cloud[n] for n in shared}, {n: local[n] for n in shared}, atol, rtol)
            if local:
                by_input.setdefault(_digest(_part(arrays, "input")), {}).setdefault(version, local)
    for answers in by_input.values():
        for a, b in itertools.combinations(sorted(answers, key=int), 2):
            result.between_versions.setdefault(f"{a}:{b}", Agreement()).add(answers[a], answers[b], atol, rtol)
    if not result.against_reference and not result.between_versions:
        result.note = (f"nothing to compare: the captured samples of model '{model}' carry no reference answers "
                       f"(cloud/...) next to a version's answers (local/...), and no input was captured for more "
                       f"than one version")
    return result


def _load(path: Path) -> Arrays:
    with np.load(path, allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


def _part(arrays: Arrays, kind: str) -> Arrays:
    prefix = f"{kind}/"
    return {name[len(prefix):]: array for name, array in arrays.items() if name.startswith(prefix)}


def _digest(inputs: Arrays) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(inputs):
        array = np.ascontiguousarray(inputs[name])
        digest.update(f"{name}\x00{array.dtype.str}\x00{array.shape}\x00".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()
