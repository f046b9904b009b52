"""The capture store: samples an edge forwarded (inputs, local and cloud outputs, the reason), kept for retraining.

Layout: ``<root>/<model>/<version>/<seq>.npz`` plus ``<root>/<model>/<version>/index.jsonl``. Each npz holds the
arrays ``input/<name>``, ``local/<name>`` and ``cloud/<name>``. An npz is written to a hidden temporary file and
renamed into place, then one index line is appended and fsynced::

    {"id": ..., "time": ..., "reason": ..., "source": ..., "edge": ..., "file": "7.npz", "bytes": 1234}

A disk that is full (ENOSPC, or a quota: EDQUOT) fails the one sample with UNAVAILABLE (HTTP 503, retryable: the
edge keeps it and sends it again later); whatever was written of it is removed, so the store stays as it was.

Sample ids are the client's: a sample whose id is already in the index is acknowledged and not stored again, so
an edge that retries after a lost reply neither loses nor duplicates a sample. When the files of the whole store
pass ``max_bytes``, the oldest are deleted and a line ``{"deleted": "7.npz", "id": ..., "time": ...}`` records it.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import threading
import time
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln._files import write_atomic
from kiln.errors import InvalidArgumentError, UnavailableError
from kiln.server.staging import check_model_name

INDEX = "index.jsonl"
KINDS = ("input", "local", "cloud")
_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class Sample:
    """What the edge says about a sample besides its arrays."""

    id: str
    reason: str = ""
    source: str = ""
    edge: str = ""


def check_sample_id(sample_id: str) -> None:
    if not _ID.fullmatch(sample_id):
        raise InvalidArgumentError(f"capture: sample id '{sample_id[:140]}' is not 1 to 128 characters of "
                                   f"A-Z a-z 0-9 . _ -")


def check_npz(model: str, payload: bytes) -> None:
    """Refuse a body that is not an npz of plain arrays named input/..., local/... or cloud/...."""
    try:
        with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
            names = list(npz.files)
            for name in names:
                npz[name]  # reads every array: a truncated or pickled one fails here
    # NotImplementedError: an entry compressed with a method zipfile lacks, or a zip version it cannot read.
    except (ValueError, OSError, zipfile.BadZipFile, EOFError, NotImplementedError) as exc:
        raise InvalidArgumentError(f"capture for model '{model}': the body is not a readable npz of arrays "
                                   f"({exc})") from None
    bad = [name for name in names if name.partition("/")[0] not in KINDS or not name.partition("/")[2]]
    if bad or not any(name.startswith("input/") for name in names):
        raise InvalidArgumentError(f"capture for model '{model}': array names must be input/<name>, "
                                   f"local/<name> or cloud/<name>, with at least one input; got "
                                   f"{', '.join(names) or 'none'}")


REPLICA_STORE_PREFIX = "replica-"  # kiln.cluster: each replica keeps a store of its own below the shared folder


class CaptureStore:
    """Samples per model and version under ``root``, at most ``max_bytes`` of npz files in all (oldest go first)."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        if max_bytes < 1:
            raise InvalidArgumentError(f"capture: the size bound must be positive, got {max_bytes} bytes")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._folders: dict[Path, _Folder] = {}
        # Every live file of the store, oldest first, to rotate across models and versions.
        self._files: list[tuple[float, Path, str]] = []
        for folder in sorted(p.parent for p in self.root.glob(f"*/*/{INDEX}")):
            self._folder(folder)
        self._files.sort()
        self.total_bytes = sum(p.stat().st_size for _, p, _ in self._files if p.exists())

    def add(self, model: str, version: str, sample: Sample, payload: bytes) -> bool:
        """Store one sample; False when its id was stored before (nothing is written then)."""
        check_model_name(model)
        if not version.isdigit():
            raise InvalidArgumentError(f"capture for model '{model}': version '{version}' is not a number")
        check_sample_id(sample.id)
        check_npz(model, payload)
        with self._lock:
            folder = self._folder(self.root / model / version)
            if sample.id in folder.ids:
                return False
            name = f"{folder.next_seq}.npz"
            path = folder.path / name
            now = time.time()
            try:
                write_atomic(path, payload)  # removes its temporary file when it fails
                folder.append({"id": sample.id, "time": now, "reason": sample.reason, "source": sample.source,
                               "edge": sample.edge, "file": name, "bytes": len(payload)})
            except OSError as exc:
                path.unlink(missing_ok=True)
                if exc.errno in _OUT_OF_SPACE:
                    raise UnavailableError(f"capture for model '{model}' version {version}: sample '{sample.id}' "
                                           f"was not stored: the capture folder {folder.path} is out of space "
                                           f"({exc.strerror}); free space or lower --capture-max-mb, then send "
                                           f"it again") from exc
                raise
            folder.ids.add(sample.id)
            folder.next_seq += 1
            self._files.append((now, path, sample.id))
            self.total_bytes += len(payload)
            self._rotate()
        return True

    def _folder(self, path: Path) -> _Folder:
        folder = self._folders.get(path)
        if folder is None:
            folder = self._folders[path] = _Folder(path)
            self._files += [(t, path / name, sid) for t, name, sid in folder.live]
        return folder

    def _rotate(self) -> None:
        while self.total_bytes > self.max_bytes and len(self._files) > 1:
            _, path, sample_id = self._files.pop(0)
            size = path.stat().st_size if path.exists() else 0
            path.unlink(missing_ok=True)
            self.total_bytes -= size
            self._folders[path.parent].append({"deleted": path.name, "id": sample_id, "time": time.time()})


class _Folder:
    """One model version's index: the ids seen, the next file number, and its live files."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self.ids: set[str] = set()
        self.next_seq = 0
        index = path / INDEX
        if index.exists() and index.stat().st_size and not index.read_bytes().endswith(b"\n"):
            self.append_text("\n")  # end a line torn by a crash, so the next entry starts on its own line
        for entry in read_index(path):
            if "deleted" not in entry:
                self.ids.add(entry["id"])
                self.next_seq = max(self.next_seq, int(Path(entry["file"]).stem) + 1)
        self.live = [(float(e["time"]), e["file"], str(e["id"])) for e in live_samples(path)]

    def append(self, entry: Mapping[str, Any]) -> None:
        self.append_text(json.dumps(entry) + "\n")

    def append_text(self, text: str) -> None:
        """Append and fsync; on failure cut the index back to where it was, so no torn line is left."""
        with (self.path / INDEX).open("a", encoding="utf-8") as f:
            size = f.tell()
            try:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            except OSError:
                with contextlib.suppress(OSError):
                    os.truncate(f.fileno(), size)
                raise


def read_index(folder: Path) -> Iterator[dict[str, Any]]:
    """The index lines of one model version; a torn last line (a crash mid-append) is skipped."""
    path = folder / INDEX
    if not path.exists():
        return
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict):
                yield entry


def live_samples(folder: Path) -> list[dict[str, Any]]:
    """Index entries of the samples still on disk, in the order they were stored."""
    entries = list(read_index(folder))
    deleted = {e["deleted"] for e in entries if "deleted" in e}
    return [e for e in entries if "deleted" not in e and e["file"] not in deleted and (folder / e["file"]).exists()]

