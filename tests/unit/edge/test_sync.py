"""Model sync without sockets: a cloud repository folder as the source, real engines, each step driven by hand."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import kiln
from kiln.cli import edge as cli_edge
from kiln.cli import make_parser
from kiln.demo.models import build_mlp
from kiln.demo.repository import render_config
from kiln.edge import EdgeRunner, Policy
from kiln.edge.options import EdgeOptions
from kiln.edge.serve import start_sync
from kiln.edge.sync import REJECTED_FILE, ModelSync, RemoteFile, SyncOptions, smoke_test, zero_inputs
from kiln.engines.base import Engine
from kiln.errors import ConfigError
from kiln.frontends.http.files import list_version_files, resolve_file
from kiln.testing.repo import write_model

Array = npt.NDArray[Any]
LOCAL = Policy(mode="local-only")


def write_mlp(root: Path, version: int, seed: int) -> Path:
    model = build_mlp(seed)
    return write_model(root, "mlp", model, render_config("mlp", model, 8).decode(), versions=(version,))


class FolderSource:
    """The cloud as a repository folder, listed by the server's own listing code; ``tamper`` alters a listing."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tamper: dict[str, RemoteFile] = {}
        self.downloads = 0

    def ready_versions(self, model: str) -> list[int]:
        return sorted(int(p.name) for p in (self.root / model).iterdir() if p.name.isdigit())

    def list_files(self, model: str, version: int) -> list[RemoteFile]:
        listed = [RemoteFile(e.path, e.size, e.sha256) for e in list_version_files(self.root / model, str(version))]
        return [self.tamper.get(f.path, f) for f in listed]

    def download(self, model: str, version: int, path: str, destination: Path) -> None:
        self.downloads += 1
        shutil.copyfile(resolve_file(self.root / model, str(version), path), destination)


def sample() -> dict[str, Array]:
    return {"INPUT0": np.random.default_rng(3).standard_normal((2, 64), dtype=np.float32)}


@pytest.fixture
def edge(tmp_path: Path) -> Path:
    return write_mlp(tmp_path / "edge", 1, seed=0)


@pytest.fixture
def cloud(tmp_path: Path) -> FolderSource:
    write_mlp(tmp_path / "cloud", 1, seed=0)
    return FolderSource(tmp_path / "cloud")


def test_newer_version_is_downloaded_verified_and_swapped_in(edge: Path, cloud: FolderSource) -> None:
    with EdgeRunner(edge, policy=LOCAL) as runner:
        sync = ModelSync(runner, cloud, edge)
        assert sync.step() is None  # nothing newer yet
        cloud_v2 = write_mlp(cloud.root, 2, seed=1)
        assert sync.step() == 2
        assert runner.version == "2"
        assert (edge / "2" / "model.onnx").read_bytes() == (cloud_v2 / "2" / "model.onnx").read_bytes()
        assert not [p for p in edge.iterdir() if p.name.startswith(".kiln-sync-")]  # staging removed
        expected = kiln.load(cloud_v2, 2).infer(sample())["OUTPUT0"]
        np.testing.assert_allclose(runner.infer(sample()).outputs["OUTPUT0"], expected, rtol=1e-6)
        sync.close()


def test_checksum_mismatch_is_rejected_once_and_the_old_version_keeps_serving(edge: Path,
                                                                              cloud: FolderSource) -> None:
    write_mlp(cloud.root, 2, seed=1)
    real = next(f for f in cloud.list_files("mlp", 2) if f.path == "2/model.onnx")
    cloud.tamper["2/model.onnx"] = RemoteFile(real.path, real.size, "0" * 64)
    with EdgeRunner(edge, policy=LOCAL) as runner:
        sync = ModelSync(runner, cloud, edge)
        assert sync.step() is None
        assert runner.version == "1"
        assert not (edge / "2").exists()
        assert sync.rejected == {2}
        downloads = cloud.downloads
        assert sync.step() is None
        assert cloud.downloads == downloads  # never retried
        sync.close()
    # The rejection survives a restart of the edge.
    with EdgeRunner(edge, policy=LOCAL) as runner:
        assert ModelSync(runner, cloud, edge).rejected == {2}
        assert (edge / REJECTED_FILE).is_file()


def test_truncated_file_fails_the_size_check(edge: Path, cloud: FolderSource) -> None:
    v2 = write_mlp(cloud.root, 2, seed=1)
    listed = {f.path: f for f in cloud.list_files("mlp", 2)}
    cloud.tamper["2/model.onnx"] = listed["2/model.onnx"]
    data = (v2 / "2" / "model.onnx").read_bytes()
    (v2 / "2" / "model.onnx").write_bytes(data[: len(data) // 2])  # changed after the listing was taken
    cloud.list_files = lambda model, version: list(listed.values())  # type: ignore[method-assign]
    with EdgeRunner(edge, policy=LOCAL) as runner:
        sync = ModelSync(runner, cloud, edge)
        assert sync.step() is None
        assert runner.version == "1" and sync.rejected == {2}
        sync.close()


def test_a_version_that_fails_to_load_is_rejected(edge: Path, cloud: FolderSource) -> None:
    v2 = write_mlp(cloud.root, 2, seed=1)
    (v2 / "2" / "model.onnx").write_bytes(b"not an onnx model")
    with EdgeRunner(edge, policy=LOCAL) as runner:
        sync = ModelSync(runner, cloud, edge)
        assert sync.step() is None
        assert runner.version == "1" and sync.rejected == {2}
        assert not (edge / "2").exists()
        sync.close()


def test_engine_errors_during_probation_roll_back(edge: Path, cloud: FolderSource) -> None:
    write_mlp(cloud.root, 2, seed=1)
    with EdgeRunner(edge, policy=LOCAL) as runner:
        before = runner.infer(sample()).outputs["OUTPUT0"]
        sync = ModelSync(runner, cloud, edge, options=SyncOptions(probation_requests=5))
        assert sync.step() == 2
        runner.infer(sample())
        # The new engine starts failing (as a broken backend would): the edge swaps the old one back.
        broken = Broken(runner.engine)
        runner.swap_engine(broken, "2")
        with pytest.raises(RuntimeError, match="broken engine"):
            runner.infer(sample())
        assert sync.step() is None
        assert runner.version == "1" and sync.rejected == {2}
        assert not (edge / "2").exists()
        np.testing.assert_array_equal(runner.infer(sample()).outputs["OUTPUT0"], before)
        assert broken.closed
        sync.close()


def test_probation_passed_releases_the_old_engine(edge: Path, cloud: FolderSource) -> None:
    write_mlp(cloud.root, 2, seed=1)
    with EdgeRunner(edge, policy=LOCAL) as runner:
        old = runner.engine
        sync = ModelSync(runner, cloud, edge, options=SyncOptions(probation_requests=2))
        assert sync.step() == 2
        for _ in range(2):
            runner.infer(sample())
        write_mlp(cloud.root, 3, seed=2)
        assert sync.step() == 3  # probation settled first, then the next version is taken
        with pytest.raises(Exception, match="closed|released|None"):
            old.infer(sample())
        sync.close()


def test_swap_waits_for_local_runs_in_flight(edge: Path) -> None:
    with EdgeRunner(Gate(kiln.load(edge)), policy=LOCAL) as runner:
        gate = runner.engine
        assert isinstance(gate, Gate)
        worker = threading.Thread(target=runner.infer, args=(sample(),))
        worker.start()
        gate.entered.wait(5)
        new = kiln.load(edge)
        swapped: list[Engine] = []
        swapper = threading.Thread(target=lambda: swapped.append(runner.swap_engine(new, "1")))
        swapper.start()
        swapper.join(0.2)
        assert swapper.is_alive()  # the old engine is still running a request
        gate.release.set()
        worker.join(5)
        swapper.join(5)
        assert swapped == [gate] and runner.engine is new
        gate.close()


def test_swap_refuses_another_model(edge: Path, tmp_path: Path) -> None:
    other = write_model(tmp_path / "o", "other", build_mlp(0), render_config("other", build_mlp(0), 8).decode())
    with EdgeRunner(edge, policy=LOCAL) as runner, pytest.raises(ConfigError, match="cannot swap"):
        runner.swap_engine(kiln.load(other), "1")


def test_smoke_test_and_zero_inputs(edge: Path) -> None:
    engine = kiln.load(edge)
    assert zero_inputs(engine.spec)["INPUT0"].shape == (1, 64)
    smoke_test(engine)
    with pytest.raises(Exception, match="non-finite"):
        smoke_test(NaNs(engine))


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="interval_s"):
        SyncOptions(interval_s=0)


class Broken(Engine):
    thread_safe = True

    def __init__(self, inner: Engine) -> None:
        super().__init__(inner.spec)
        self.inner = inner
        self.closed = False

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        raise RuntimeError("broken engine")

    def close(self) -> None:
        self.closed = True
        self.inner.close()


class NaNs(Broken):
    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        return {name: np.full_like(array, np.nan) for name, array in self.inner.execute(inputs, outputs).items()}


class Gate(Broken):
    """Holds each run until released, to catch a request in flight."""

    def __init__(self, inner: Engine) -> None:
        super().__init__(inner)
        self.entered = threading.Event()
        self.release = threading.Event()

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        self.entered.set()
        self.release.wait(5)
        return self.inner.execute(inputs, outputs)


def test_a_version_of_another_model_is_rejected_and_not_installed(edge: Path, cloud: FolderSource) -> None:
    model = build_mlp(1)
    (cloud.root / "mlp" / "2").mkdir()
    (cloud.root / "mlp" / "2" / "model.onnx").write_bytes(model.SerializeToString())
    (cloud.root / "mlp" / "config.pbtxt").write_bytes(render_config("other", model, 8))
    config = (edge / "config.pbtxt").read_bytes()
    with EdgeRunner(edge, policy=LOCAL) as runner:
        sync = ModelSync(runner, cloud, edge)
        assert sync.step() is None
        assert runner.version == "1" and sync.rejected == {2}
        assert not (edge / "2").exists()
        assert (edge / "config.pbtxt").read_bytes() == config
        sync.close()


def test_cli_flags_start_the_watcher_only_when_asked(edge: Path, tmp_path: Path) -> None:
    with EdgeRunner(edge, policy=LOCAL) as runner:
        assert start_sync(edge_options(str(edge)), runner) is None
        with pytest.raises(ConfigError, match="needs --cloud-url"):
            start_sync(edge_options(str(edge), "--sync-interval-s", "1"), runner)
        options = edge_options(str(edge / "1" / "model.onnx"), "--sync-interval-s", "1", "--cloud-url", "h:1")
        with pytest.raises(ConfigError, match="give --model-dir"):
            start_sync(options, runner)
        # A started watcher (it needs a cloud) is covered by tests/integration/test_edge_sync.py.


def edge_options(*argv: str) -> EdgeOptions:
    """The options `kiln edge ARGV` runs with."""
    return cli_edge.edge_options(make_parser().parse_args(["edge", *argv]))
