"""The edge's capture queue and uploader: samples on disk survive a restart, the bound drops the oldest, a sample
leaves the queue only once the cloud acknowledged it. The cloud here is a small HTTP server in front of the real
capture store; tests/integration/test_edge_capture.py runs the whole path against `kiln serve`."""

from __future__ import annotations

import http.server
import io
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kiln.cli import edge as cli_edge
from kiln.cli import make_parser
from kiln.demo.models import build_mlp
from kiln.edge import EdgeRunner, Policy
from kiln.edge.capture import ACKED, QUEUE_FOLDER, REJECTED, RETRY, CaptureQueue, CaptureUploader, EdgeCapture
from kiln.edge.options import EdgeOptions
from kiln.edge.serve import start_capture
from kiln.errors import ConfigError, InvalidArgumentError
from kiln.server.capture import CaptureStore, Sample, live_samples, read_index
from kiln.testing.serve import free_port


def put(queue: CaptureQueue, value: float, cloud: bool = True) -> str:
    x = {"INPUT0": np.full((1, 4), value, np.float32)}
    local = {"OUTPUT0": np.full((1, 3), value, np.float32)}
    return queue.put("1", x, local, local if cloud else None, ["uncertain (row 0)"], "cloud")


class _Cloud(http.server.ThreadingHTTPServer):
    store: CaptureStore
    fail_next: int = 0  # answer 503 to this many requests first


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Cloud

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.server.fail_next > 0:
            self.server.fail_next -= 1
            return self._answer(503, b'{"error": "busy"}')
        _, _, model, _, version, _ = self.path.strip("/").split("/")[1:]
        sample = Sample(self.headers["Kiln-Capture-Id"], urllib.parse.unquote(self.headers["Kiln-Capture-Reason"]),
                        self.headers["Kiln-Capture-Source"], self.headers["Kiln-Edge-Id"])
        try:
            self.server.store.add(model, version, sample, body)
        except InvalidArgumentError as exc:
            return self._answer(400, str(exc).encode())
        self._answer(200, b"{}")

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[_Cloud]:
    server = _Cloud(("127.0.0.1", 0), _Handler)
    server.store = CaptureStore(tmp_path / "cloud", 1 << 20)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def url(server: _Cloud) -> str:
    return f"127.0.0.1:{server.server_address[1]}"


def test_queued_samples_survive_a_restart_in_order_and_half_written_ones_are_cleaned(tmp_path: Path) -> None:
    queue = CaptureQueue(tmp_path)
    ids = [put(queue, i) for i in range(3)]
    (tmp_path / ".x.npz.tmp").write_bytes(b"partial")
    (tmp_path / "99999999999999999999-orphan.npz").write_bytes(b"no json")
    reopened = CaptureQueue(tmp_path)
    assert reopened.pending() == ids
    meta, payload = reopened.read(ids[1])
    assert meta == {"id": ids[1], "version": "1", "reason": "uncertain (row 0)", "source": "cloud"}
    assert payload[:2] == b"PK"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{i}.{ext}" for i in ids for ext in ("npz", "json"))


def test_the_bound_drops_the_oldest_and_counts_them(tmp_path: Path) -> None:
    queue = CaptureQueue(tmp_path, max_samples=2)
    ids = [put(queue, i) for i in range(4)]
    assert queue.pending() == ids[2:]
    assert queue.stats.snapshot()["dropped"] == 2 and queue.stats.snapshot()["queued"] == 4
    size = (tmp_path / f"{ids[3]}.npz").stat().st_size
    by_bytes = CaptureQueue(tmp_path / "b", max_bytes=size * 2)
    kept = [put(by_bytes, i) for i in range(3)][1:]
    assert by_bytes.pending() == kept


def test_a_sample_is_deleted_only_after_the_cloud_acknowledged_it(tmp_path: Path, cloud: _Cloud) -> None:
    queue = CaptureQueue(tmp_path / "queue")
    first = put(queue, 1.0)
    unreachable = CaptureUploader(queue, f"127.0.0.1:{free_port()}", "mlp", edge_id="e1")
    assert unreachable.upload(first) == RETRY
    cloud.fail_next = 1
    uploader = CaptureUploader(queue, url(cloud), "mlp", edge_id="e1")
    assert uploader.upload(first) == RETRY
    assert queue.pending() == [first]
    assert uploader.upload(first) == ACKED
    assert queue.pending() == []
    [entry] = live_samples(tmp_path / "cloud" / "mlp" / "1")
    assert (entry["id"], entry["reason"], entry["source"], entry["edge"]) == (first, "uncertain (row 0)", "cloud",
                                                                             "e1")
    with np.load(tmp_path / "cloud" / "mlp" / "1" / entry["file"]) as npz:
        assert sorted(npz.files) == ["cloud/OUTPUT0", "input/INPUT0", "local/OUTPUT0"]


def test_a_sample_the_cloud_refuses_as_malformed_is_dropped(tmp_path: Path, cloud: _Cloud) -> None:
    queue = CaptureQueue(tmp_path / "queue")
    sample_id = put(queue, 1.0)
    (tmp_path / "queue" / f"{sample_id}.npz").write_bytes(b"garbage")
    assert CaptureUploader(queue, url(cloud), "mlp").upload(sample_id) == REJECTED
    assert queue.pending() == [] and queue.stats.snapshot()["rejected"] == 1


def test_the_thread_resends_after_failures_and_a_lost_reply_duplicates_nothing(tmp_path: Path,
                                                                               cloud: _Cloud) -> None:
    queue = CaptureQueue(tmp_path / "queue")
    ids = [put(queue, i, cloud=i % 2 == 0) for i in range(4)]
    # A reply lost after the cloud stored the sample: the edge sends it again, the cloud keeps one copy.
    CaptureUploader(queue, url(cloud), "mlp").upload(ids[0])
    (tmp_path / "queue" / f"{ids[0]}.npz").write_bytes((tmp_path / "cloud" / "mlp" / "1" / "0.npz").read_bytes())
    (tmp_path / "queue" / f"{ids[0]}.json").write_text(f'{{"id": "{ids[0]}", "version": "1", "reason": "", '
                                                       f'"source": "cloud"}}')
    cloud.fail_next = 2
    uploader = CaptureUploader(queue, url(cloud), "mlp", min_backoff_s=0.01, max_backoff_s=0.05)
    uploader.start()
    deadline = time.monotonic() + 10
    while queue.pending() and time.monotonic() < deadline:
        time.sleep(0.02)
    uploader.close()
    assert queue.pending() == []
    assert [e["id"] for e in read_index(tmp_path / "cloud" / "mlp" / "1")] == ids


def test_bounds_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_samples"):
        CaptureQueue(tmp_path, max_samples=0)


@pytest.fixture(scope="module")
def mlp_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mlp") / "mlp.onnx"
    path.write_bytes(build_mlp().SerializeToString())
    return path


def test_shadow_copies_the_cloud_did_not_take_are_captured_without_cloud_outputs(tmp_path: Path,
                                                                                  mlp_file: Path) -> None:
    policy = Policy(mode="shadow", entropy_above=0.0)  # every request is forwarded
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    runner = EdgeRunner(mlp_file, f"127.0.0.1:{free_port()}", policy, cloud_timeout_s=1.0)
    capture = EdgeCapture(runner, tmp_path)
    runner.on_forwarded = capture._put  # the queue without its uploader, so the sample stays to be read
    try:
        assert runner.infer({"INPUT0": x}).source == "local"
    finally:
        runner.close()  # waits for the shadow copy, which is captured once the cloud did not take it
    [sample_id] = capture.queue.pending()
    meta, payload = capture.queue.read(sample_id)
    assert meta["source"] == "local" and meta["reason"].startswith("entropy of OUTPUT0 above 0.0")
    with np.load(io.BytesIO(payload)) as npz:
        assert sorted(npz.files) == ["input/INPUT0", "local/OUTPUT0"]
        np.testing.assert_array_equal(npz["input/INPUT0"], x)


def test_edge_capture_flag_needs_a_cloud(mlp_file: Path, tmp_path: Path) -> None:
    with EdgeRunner(mlp_file, None, Policy(mode="local-only")) as runner:
        assert start_capture(edge_options(str(mlp_file)), runner) is None
        with pytest.raises(ConfigError, match="--capture needs --cloud-url"):
            start_capture(edge_options(str(mlp_file), "--capture"), runner)
    with EdgeRunner(mlp_file, f"127.0.0.1:{free_port()}", Policy()) as runner:
        capture = start_capture(edge_options(str(mlp_file), "--capture", "--model-dir", str(tmp_path)), runner)
        assert capture is not None and capture.queue.folder == tmp_path / QUEUE_FOLDER
        assert runner.on_forwarded is not None
        capture.close()
        assert runner.on_forwarded is None


def edge_options(*argv: str) -> EdgeOptions:
    """The options `kiln edge ARGV` runs with."""
    return cli_edge.edge_options(make_parser().parse_args(["edge", *argv]))
