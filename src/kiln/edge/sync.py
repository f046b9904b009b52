"""Model sync: the edge picks up newer versions of its model from the cloud, and drops one that fails.

Each poll asks the cloud's repository index (``POST /v2/repository/index``) for the versions that are READY.
When one is newer than the version the edge runs and was never rejected, its files are listed and downloaded
through kiln's model-download extension (``kiln serve --allow-model-download``) into a hidden staging folder
under the edge's model folder; every file's size and sha256 must match the listing. The staged version is loaded
with :func:`kiln.load` and given a smoke inference (zeros of the model's input shapes, batch 1): every output
must come back, finite, with the shape the model's config gives. Only then is the version folder
renamed into ``<model_dir>/<version>/`` and the engine swapped into the runner (requests in flight finish on the
old engine).

The old engine stays loaded while the new version is on probation (its first ``probation_requests`` local
runs). An engine error during probation swaps the old engine back, deletes the version folder and rejects the
version. Rejected versions (a corrupt download, a failed load or smoke test, a rollback) are recorded in
``<model_dir>/.kiln-sync-rejected.json`` and never tried again. A full disk (ENOSPC, EDQUOT) while staging or
installing is no fault of the version: what was written is removed, the served version stays, and the version is
tried again at the next poll.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import shutil
import ssl
import tempfile
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Protocol, cast

import numpy as np
import numpy.typing as npt

import kiln
from kiln.config.parse import CONFIG_FILENAME
from kiln.config.spec import ModelSpec
from kiln.edge.runner import EdgeRunner
from kiln.engines.base import Engine
from kiln.errors import ConfigError, KilnError
from kiln.tensor import DataType
from kiln.v2.client import HttpClient

Array = npt.NDArray[Any]
log = logging.getLogger("kiln.edge.sync")
REJECTED_FILE = ".kiln-sync-rejected.json"
_CHUNK = 1 << 20
_OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)


class SyncError(Exception):
    """A version that cannot be taken: the message says why."""


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str


class SyncSource(Protocol):
    """Where new versions come from (the cloud's HTTP API, or a test double)."""

    def ready_versions(self, model: str) -> list[int]: ...

    def list_files(self, model: str, version: int) -> list[RemoteFile]: ...

    def download(self, model: str, version: int, path: str, destination: Path) -> None: ...


class HttpSyncSource:
    """The cloud kiln server over HTTP(S); every request carries the API key when there is one. ``tls`` is the SSL
    context of an https URL (see :func:`kiln.edge.tls.client_context`)."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 30.0,
                 tls: ssl.SSLContext | None = None) -> None:
        self.http = HttpClient(url, timeout_s=timeout_s, api_key=api_key, tls=tls, what="cloud url")

    def ready_versions(self, model: str) -> list[int]:
        with self.http:  # polls are far apart: no connection is kept between them
            entries = self.http.repository_index(ready_only=True)
        return sorted(int(e["version"]) for e in entries
                      if e.get("name") == model and e.get("state") == "READY" and str(e.get("version")).isdigit())

    def list_files(self, model: str, version: int) -> list[RemoteFile]:
        with self.http:
            doc = self.http.get(_files_path(model, version))
        return [RemoteFile(str(e["path"]), int(e["size"]), str(e["sha256"])) for e in doc]

    def download(self, model: str, version: int, path: str, destination: Path) -> None:
        """Write one file to ``destination``; a local write error (a full disk) is raised as the OSError it is,
        not as the unreachable cloud the HTTP client would report."""
        quoted = urllib.parse.quote(path, safe="/")
        with destination.open("wb") as file:
            sink = _LocalWrites(file)
            try:
                self.http.download(f"{_files_path(model, version)}/{quoted}", cast(BinaryIO, sink), _CHUNK)
            except KilnError:
                if sink.error is not None:
                    raise sink.error from None
                raise


class _LocalWrites:
    """A file that remembers the error its last write raised."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise


@dataclass(frozen=True)
class SyncOptions:
    interval_s: float = 30.0
    probation_requests: int = 20  # local runs a new version must pass before the old engine is released

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.probation_requests < 1:
            raise ConfigError(f"edge sync: interval_s ({self.interval_s}) must be > 0 and probation_requests "
                              f"({self.probation_requests}) >= 1")


class ModelSync:
    """Keeps ``runner`` on the newest good version that ``source`` has of ``model`` (default: the runner's)."""

    def __init__(self, runner: EdgeRunner, source: SyncSource, model_dir: Path, *, model: str | None = None,
                 options: SyncOptions | None = None, **load_options: Any) -> None:
        self.runner = runner
        self.source = source
        self.model_dir = Path(model_dir)
        self.model = model or runner.name
        self.options = options or SyncOptions()
        self.load_options = load_options
        self.rejected: set[int] = _read_rejected(self.model_dir)
        self._lock = threading.Lock()
        self._previous: tuple[Engine, str] | None = None  # kept for rollback while on probation
        self._config_backup: bytes | None = None
        self._watched: str | None = None  # the version on probation
        self._probation = 0
        self._failed = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        runner.on_local_result = self._on_result

    # -- one step ----------------------------------------------------------------------------------------------

    def step(self) -> int | None:
        """Settle a probation that ended, then take a newer version if the cloud has one. Returns the version
        swapped in (None when nothing changed)."""
        self._settle()
        if self._previous is not None:
            return None  # one new version at a time
        try:
            versions = self.source.ready_versions(self.model)
        except (KilnError, OSError, SyncError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.info("model '%s': cloud index not available: %s", self.model, exc)
            return None
        current = int(self.runner.version) if self.runner.version.isdigit() else 0
        newer = [v for v in versions if v > current and v not in self.rejected]
        if not newer:
            return None
        version = newer[-1]
        try:
            self._take(version)
        except OSError as exc:
            if exc.errno not in _OUT_OF_SPACE:
                self._reject(version, str(exc))
            else:
                log.warning("model '%s': version %d not taken: out of space in %s (%s); version %s keeps "
                            "serving, the next poll tries again", self.model, version, self.model_dir, exc,
                            self.runner.version or "unversioned")
            return None
        except (SyncError, KilnError, ValueError, KeyError, TypeError) as exc:
            self._reject(version, str(exc))
            return None
        return version

    def _take(self, version: int) -> None:
        staging = Path(tempfile.mkdtemp(prefix=".kiln-sync-", dir=self.model_dir))
        try:
            staged = staging / self.runner.name  # the folder name is the model name kiln.load falls back to
            self._fetch(version, staged)
            engine = kiln.load(staged, version, **self.load_options)
            try:
                smoke_test(engine)
                self._install(staged, version)
            except BaseException:
                engine.close()
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        old_version = self.runner.version
        with self._lock:  # before the swap, so the very first requests on the new version count
            self._watched, self._probation, self._failed = str(version), self.options.probation_requests, False
        try:
            old = self.runner.swap_engine(engine, str(version))
        except BaseException:
            with self._lock:
                self._watched = None
            engine.close()
            self._uninstall(version)
            raise
        with self._lock:
            self._previous = (old, old_version)
        log.info("model '%s': version %d is serving (was %s); on probation for %d requests", self.model, version,
                 old_version or "unversioned", self.options.probation_requests)

    def _fetch(self, version: int, staged: Path) -> None:
        files = self.source.list_files(self.model, version)
        if not any(f.path.startswith(f"{version}/") for f in files):
            raise SyncError(f"version {version} lists no file under '{version}/'")
        for remote in files:
            target = staged / _safe_relative(remote.path, version)
            target.parent.mkdir(parents=True, exist_ok=True)
            self.source.download(self.model, version, remote.path, target)
            size, digest = target.stat().st_size, _sha256(target)
            if size != remote.size or digest != remote.sha256:
                raise SyncError(f"'{remote.path}' does not match the listing: {size} bytes, sha256 {digest[:12]}..., "
                                f"expected {remote.size} bytes, sha256 {remote.sha256[:12]}...")

    def _install(self, staged: Path, version: int) -> None:
        """Move the verified version folder (and a changed config.pbtxt) into the model folder."""
        target = self.model_dir / str(version)
        if target.exists():
            shutil.rmtree(target)
        (staged / str(version)).rename(target)
        try:
            self._install_config(staged / CONFIG_FILENAME)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise

    def _install_config(self, config: Path) -> None:
        local = self.model_dir / CONFIG_FILENAME
        self._config_backup = local.read_bytes() if local.is_file() else None
        if config.is_file() and config.read_bytes() != self._config_backup:
            tmp = self.model_dir / f".{CONFIG_FILENAME}.kiln-sync"
            try:
                shutil.copyfile(config, tmp)
                tmp.replace(local)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise

    # -- probation and rollback --------------------------------------------------------------------------------

    def _on_result(self, version: str, ok: bool) -> None:
        with self._lock:
            if version != self._watched or self._probation == 0:
                return
            if not ok:
                self._failed = True
            else:
                self._probation -= 1
            if self._failed or self._probation == 0:
                self._wake.set()

    def _settle(self) -> None:
        with self._lock:
            previous, failed, done = self._previous, self._failed, self._probation == 0
        if previous is None or not (failed or done):
            return
        if not failed:
            previous[0].close()
            log.info("model '%s': version %s passed probation; version %s released", self.model,
                     self.runner.version, previous[1] or "unversioned")
        else:
            bad = self.runner.version
            self.runner.swap_engine(previous[0], previous[1]).close()
            self._uninstall(int(bad))
            self._reject(int(bad), "the local engine failed on a request during probation; rolled back to "
                                   f"version {previous[1] or 'unversioned'}")
        with self._lock:
            self._previous, self._watched, self._failed = None, None, False

    def _uninstall(self, version: int) -> None:
        shutil.rmtree(self.model_dir / str(version), ignore_errors=True)
        if self._config_backup is not None:
            (self.model_dir / CONFIG_FILENAME).write_bytes(self._config_backup)

    def _reject(self, version: int, why: str) -> None:
        log.warning("model '%s': version %d rejected: %s", self.model, version, why)
        self.rejected.add(version)
        path = self.model_dir / REJECTED_FILE
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(sorted(self.rejected)))
            tmp.replace(path)
        except OSError as exc:  # remembered until a restart all the same
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            log.warning("model '%s': could not record the rejection in %s: %s", self.model, path, exc)

    # -- the background thread ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kiln-edge-sync", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:  # the watcher must outlive any one bad poll
                log.exception("model '%s': sync step failed", self.model)
            self._wake.wait(self.options.interval_s)
            self._wake.clear()

    def close(self) -> None:
        """Stop polling and release an engine kept for rollback (the runner keeps the one serving)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self.runner.on_local_result = None
        with self._lock:
            previous, self._previous = self._previous, None
        if previous is not None:
            previous[0].close()


def smoke_test(engine: Engine) -> None:
    """One inference on zeros (batch 1): every output present, finite, and shaped as the model's config says."""
    spec = engine.spec
    outputs = engine.infer(zero_inputs(spec))
    for tensor in spec.outputs:
        if tensor.name not in outputs:
            raise SyncError(f"smoke inference: output '{tensor.name}' is missing")
        array = np.asarray(outputs[tensor.name])
        if array.dtype.kind in "fc" and not np.all(np.isfinite(array)):
            raise SyncError(f"smoke inference: output '{tensor.name}' has non-finite values")
        dims = ((1,) if spec.batching else ()) + tuple(tensor.dims)
        if len(array.shape) != len(dims) or any(d >= 0 and d != n for d, n in zip(dims, array.shape, strict=True)):
            raise SyncError(f"smoke inference: output '{tensor.name}' has shape {array.shape}, the config says "
                            f"{list(dims)}")


def zero_inputs(spec: ModelSpec) -> dict[str, Array]:
    arrays: dict[str, Array] = {}
    for tensor in spec.inputs:
        shape = ((1,) if spec.batching else ()) + tuple(1 if d < 0 else d for d in tensor.dims)
        if tensor.datatype is DataType.BYTES:
            arrays[tensor.name] = np.full(shape, b"", dtype=object)
        else:
            arrays[tensor.name] = np.zeros(shape, tensor.datatype.numpy_dtype)
    return arrays


def _safe_relative(path: str, version: int) -> Path:
    """A listed path as a relative local path: config.pbtxt or under the version folder, nothing else."""
    pure = PurePosixPath(path)
    if path == CONFIG_FILENAME:
        return Path(path)
    if pure.is_absolute() or "\\" in path or pure.parts[0] != str(version) or \
            any(part in ("", ".", "..") or part.startswith(".") for part in pure.parts):
        raise SyncError(f"the cloud listed '{path}', which is not config.pbtxt or a file under '{version}/'")
    return Path(*pure.parts)


def _files_path(model: str, version: int) -> str:
    return f"/v2/kiln/models/{urllib.parse.quote(model, safe='')}/versions/{version}/files"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _read_rejected(model_dir: Path) -> set[int]:
    path = model_dir / REJECTED_FILE
    if not path.is_file():
        return set()
    try:
        return {int(v) for v in json.loads(path.read_text())}
    except (ValueError, TypeError):
        log.warning("%s is unreadable; starting with no rejected versions", path)
        return set()
