"""Capture at the edge: forwarded requests are kept on disk and uploaded to the cloud's capture store.

Each forwarded request (cloud-fallback or shadow) becomes one sample in ``<model-dir>/.kiln-capture-queue/``: an
npz with ``input/<name>``, ``local/<name>`` and ``cloud/<name>`` arrays and a JSON file with the id, model version,
reason and source. The npz is written first and the JSON last, each to a temporary file renamed into place, so a
sample is in the queue exactly when its JSON is there. The queue keeps at most ``max_samples`` samples and
``max_bytes`` bytes; past either, the oldest are dropped and counted.

The uploader sends queued samples oldest first to ``POST /v2/kiln/models/{name}/versions/{v}/capture`` and deletes
one only after the cloud acknowledged it (a repeated id is acknowledged without a second copy, so a lost reply
costs nothing). While the cloud cannot be reached it waits, doubling the wait up to ``max_backoff_s``; the edge
keeps answering locally meanwhile. The queue is read from disk at start, so samples survive a restart.
"""

from __future__ import annotations

import io
import json
import logging
import socket
import ssl
import threading
import time
import urllib.parse
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln._files import write_atomic
from kiln.edge.counters import Counters
from kiln.edge.runner import EdgeRunner
from kiln.errors import ConfigError
from kiln.v2.client import HttpClient, ServerUnreachableError
from kiln.v2.client.calls import error_text

Array = npt.NDArray[Any]
log = logging.getLogger("kiln.edge.capture")

QUEUE_FOLDER = ".kiln-capture-queue"


@dataclass
class CaptureStats(Counters):
    queued: int = 0
    uploaded: int = 0
    dropped: int = 0  # pushed out of a full queue, or not writable
    rejected: int = 0  # refused by the cloud as malformed (400); retrying would not help


class CaptureQueue:
    """Samples waiting for upload, oldest first, in ``folder``."""

    def __init__(self, folder: Path, *, max_samples: int = 10_000, max_bytes: int = 512 * 2**20) -> None:
        if max_samples < 1 or max_bytes < 1:
            raise ConfigError(f"capture queue: max_samples ({max_samples}) and max_bytes ({max_bytes}) must be >= 1")
        self.folder = Path(folder)
        self.max_samples = max_samples
        self.max_bytes = max_bytes
        self.stats = CaptureStats()
        self.added = threading.Event()  # set when a sample is queued, so the uploader wakes at once
        self._lock = threading.Lock()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._clean()

    def _clean(self) -> None:
        """Remove what a crash left half-written: temporary files and an npz whose JSON never came."""
        for path in self.folder.iterdir():
            if path.name.startswith(".") or (path.suffix == ".npz" and not path.with_suffix(".json").exists()):
                path.unlink(missing_ok=True)

    def put(self, version: str, inputs: Mapping[str, Array], local: Mapping[str, Array] | None,
            cloud: Mapping[str, Array] | None, reasons: Sequence[str], source: str) -> str:
        """Queue one sample and return its id."""
        arrays = {f"input/{n}": np.asarray(a) for n, a in inputs.items()}
        arrays |= {f"local/{n}": np.asarray(a) for n, a in (local or {}).items()}
        arrays |= {f"cloud/{n}": np.asarray(a) for n, a in (cloud or {}).items()}
        buffer = io.BytesIO()
        save: Any = np.savez  # numpy's stubs mistake array keywords for its allow_pickle flag
        save(buffer, **arrays)
        sample_id = f"{time.time_ns():020d}-{uuid.uuid4().hex[:12]}"  # sorts by time: oldest first
        meta = {"id": sample_id, "version": version or "0", "reason": "; ".join(reasons), "source": source}
        with self._lock:
            write_atomic(self.folder / f"{sample_id}.npz", buffer.getvalue())
            write_atomic(self.folder / f"{sample_id}.json", json.dumps(meta).encode())
            self._bound()
        self.stats.add(queued=1)
        self.added.set()
        return sample_id

    def _bound(self) -> None:
        ids = self.pending()
        sizes = {i: _size(self.folder / f"{i}.npz") for i in ids}
        total = sum(sizes.values())
        while ids and (len(ids) > self.max_samples or total > self.max_bytes):
            oldest = ids.pop(0)
            total -= sizes[oldest]
            self.remove(oldest)
            self.stats.add(dropped=1)
            log.warning("capture queue full (%d samples, %d bytes at most): dropped the oldest sample %s",
                        self.max_samples, self.max_bytes, oldest)

    def pending(self) -> list[str]:
        """Ids of the queued samples, oldest first."""
        return sorted(p.stem for p in self.folder.glob("*.json") if not p.name.startswith("."))

    def read(self, sample_id: str) -> tuple[dict[str, Any], bytes]:
        meta = json.loads((self.folder / f"{sample_id}.json").read_bytes())
        return meta, (self.folder / f"{sample_id}.npz").read_bytes()

    def remove(self, sample_id: str) -> None:
        # The JSON goes first: without it the sample is no longer queued, and a leftover npz is cleaned at start.
        (self.folder / f"{sample_id}.json").unlink(missing_ok=True)
        (self.folder / f"{sample_id}.npz").unlink(missing_ok=True)


ACKED = "acked"
REJECTED = "rejected"
RETRY = "retry"


class CaptureUploader:
    """A thread that empties ``queue`` into the capture store of the cloud at ``url`` (``tls``: the SSL context
    of an https URL)."""

    def __init__(self, queue: CaptureQueue, url: str, model: str, *, api_key: str | None = None,
                 edge_id: str | None = None, timeout_s: float = 10.0, min_backoff_s: float = 0.5,
                 max_backoff_s: float = 30.0, tls: ssl.SSLContext | None = None) -> None:
        self.queue = queue
        self.http = HttpClient(url, timeout_s=timeout_s, api_key=api_key, tls=tls, what="cloud url")
        self.model = model
        self.edge_id = edge_id or socket.gethostname()
        self.timeout_s = timeout_s
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kiln-edge-capture", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop uploading; what is still queued stays on disk for the next start."""
        self._stop.set()
        self.queue.added.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        backoff = self.min_backoff_s
        while not self._stop.is_set():
            self.queue.added.clear()
            pending = self.queue.pending()
            if not pending:
                self.queue.added.wait(self.max_backoff_s)
                continue
            outcome = self.upload(pending[0])
            if outcome == RETRY:
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
            else:
                backoff = self.min_backoff_s

    def upload(self, sample_id: str) -> str:
        """Send one queued sample; it leaves the queue when acknowledged or refused as malformed."""
        try:
            meta, payload = self.queue.read(sample_id)
        except (OSError, ValueError) as exc:
            log.warning("capture queue: sample %s is unreadable and dropped: %s", sample_id, exc)
            self.queue.remove(sample_id)
            self.queue.stats.add(dropped=1)
            return REJECTED
        status, text = self._post(meta, payload)
        if status == 200:
            self.queue.remove(sample_id)
            self.queue.stats.add(uploaded=1)
            return ACKED
        if status == 400:
            log.warning("capture: the cloud refused sample %s, dropped: %s", sample_id, text)
            self.queue.remove(sample_id)
            self.queue.stats.add(rejected=1)
            return REJECTED
        log.info("capture: sample %s not uploaded yet (%s): %s", sample_id, status or "unreachable", text)
        return RETRY

    def _post(self, meta: Mapping[str, Any], payload: bytes) -> tuple[int, str]:
        """(status, error text); status 0 when the cloud could not be reached."""
        model = urllib.parse.quote(self.model, safe="")
        path = f"/v2/kiln/models/{model}/versions/{meta['version']}/capture"
        headers = {"Content-Type": "application/octet-stream", "Kiln-Capture-Id": meta["id"],
                   "Kiln-Capture-Reason": urllib.parse.quote(meta["reason"]),
                   "Kiln-Capture-Source": meta["source"], "Kiln-Edge-Id": self.edge_id}
        try:
            with self.http:  # one connection per upload: samples come seconds apart
                response = self.http.request("POST", path, payload, headers)
        except ServerUnreachableError as exc:
            return 0, exc.message
        return response.status, error_text(response.body) if not response.ok else ""


class EdgeCapture:
    """Capture for one runner: its forwarded requests go into a queue in ``model_dir``, uploaded to its cloud
    (over the same TLS settings as the runner's cloud client)."""

    def __init__(self, runner: EdgeRunner, model_dir: Path, *, api_key: str | None = None,
                 edge_id: str | None = None, max_samples: int = 10_000, max_bytes: int = 512 * 2**20,
                 min_backoff_s: float = 0.5, max_backoff_s: float = 30.0) -> None:
        if runner.cloud is None:
            raise ConfigError(f"edge capture for model '{runner.name}' needs a cloud url to upload to")
        self.runner = runner
        self.queue = CaptureQueue(Path(model_dir) / QUEUE_FOLDER, max_samples=max_samples, max_bytes=max_bytes)
        self.uploader = CaptureUploader(self.queue, runner.cloud.url, runner.cloud.model, api_key=api_key,
                                        edge_id=edge_id, timeout_s=max(runner.cloud.timeout_s, 10.0),
                                        min_backoff_s=min_backoff_s, max_backoff_s=max_backoff_s,
                                        tls=runner.cloud.tls)

    def start(self) -> EdgeCapture:
        self.runner.on_forwarded = self._put
        self.uploader.start()
        return self

    def _put(self, inputs: Mapping[str, Array], local: dict[str, Array] | None, cloud: dict[str, Array] | None,
             reasons: list[str], source: str) -> None:
        try:
            self.queue.put(self.runner.version, inputs, local, cloud, reasons, source)
        except OSError as exc:  # a full disk must not fail the request
            self.queue.stats.add(dropped=1)
            log.warning("capture queue %s: sample not written: %s", self.queue.folder, exc)

    def close(self) -> None:
        """Stop capturing and uploading; the queue stays on disk."""
        self.runner.on_forwarded = None
        self.uploader.close()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0

