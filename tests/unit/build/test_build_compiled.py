"""kiln build --backend torch with torch.compile: --compile-mode auto, compile_cache.bin and the load times.

On the CPU: a tiny MLP compiled by Inductor (C++). The build's own fresh-process load runs with an empty Inductor
cache, so its cache hits can only come from compile_cache.bin; the in-process loads below use an empty Inductor
cache too, so a cache that is not used shows as graphs compiled anew (torch's counters), not as time.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest

import kiln
from kiln.build import BuildOptions, build
from kiln.build.backends import BuildContext, BuildResult
from kiln.build.calibration import generate_samples
from kiln.build.progress import Progress
from kiln.build.report import BuildReport
from kiln.build.sources import OnnxSource
from kiln.build.torch_compile import MIN_GAIN, choose
from kiln.demo.models import build_mlp

torch = pytest.importorskip("torch")

from kiln.engines.torch import TorchEngine  # noqa: E402  # after the skip: it imports torch
from kiln.engines.torch.compile_cache import CACHE_FILENAME  # noqa: E402

X = np.random.default_rng(4).standard_normal((3, 64)).astype(np.float32)


@pytest.fixture(scope="module")
def mlp_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("source") / "mlp.onnx"
    onnx.save(build_mlp(0), str(path))
    return path


@pytest.fixture(scope="module")
def compiled_build(mlp_file: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BuildReport]:
    out = tmp_path_factory.mktemp("repo") / "mlp"
    report = build(mlp_file, out, BuildOptions(backend="torch", compile_mode="default", max_batch_size=4,
                                               progress=False))
    return out, report


@pytest.fixture
def empty_inductor_cache(tmp_path: Path) -> Iterator[None]:
    """A fresh, empty Inductor cache and no graphs compiled in this process, as on a machine that never compiled."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    torch._dynamo.reset()
    with temporary_cache_dir(str(tmp_path / "inductor")):
        yield
    torch._dynamo.reset()


def reference(x: np.ndarray, source: Path) -> np.ndarray:
    with kiln.load(source) as engine:
        return np.asarray(engine.infer({"INPUT0": x})["OUTPUT0"])


def copied_version(out: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "mlp"
    shutil.copytree(out, folder)
    return folder


@pytest.mark.slow
def test_a_compiled_build_keeps_its_cache_and_a_fresh_process_loads_every_graph_from_it(
        compiled_build: tuple[Path, BuildReport]) -> None:
    out, report = compiled_build
    assert report.passed and (out / "1" / CACHE_FILENAME).is_file()
    assert 'key: "compile_mode"' in (out / "config.pbtxt").read_text()
    details = json.loads((out / "1" / "build_report.json").read_text())["details"]["compile"]
    assert details["requested"] == details["mode"] == "default"
    fresh = details["cache"]["fresh_process"]
    # The fresh process's Inductor cache was empty: its hits came from compile_cache.bin. Two graphs: every batch
    # size but 1 (dynamic), and 1.
    assert fresh["cache"] == "loaded" and fresh["fx_graph_hits"] == 2 and fresh["fx_graph_misses"] == 0
    assert details["load_s"]["compiled_cold"] > 0 and details["load_s"]["compiled_cached"] == fresh["load_s"]
    assert "compile mode: default" in report.summary()


@pytest.mark.slow
def test_a_version_loads_its_graphs_from_the_cache_in_process(compiled_build: tuple[Path, BuildReport],
                                                              mlp_file: Path, tmp_path: Path,
                                                              empty_inductor_cache: None) -> None:
    with kiln.load(copied_version(compiled_build[0], tmp_path)) as engine:
        assert isinstance(engine, TorchEngine)
        assert engine.compile_cache is not None and engine.compile_cache.status == "loaded"
        counts = engine.compile_counts
        assert counts is not None and (counts.hits, counts.misses) == (2, 0)
        np.testing.assert_allclose(engine.infer({"INPUT0": X})["OUTPUT0"], reference(X, mlp_file), rtol=1e-4,
                                   atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(("damage", "status", "said"), [
    (lambda data: b"garbage" + data, "unreadable", "not a kiln compile cache"),
    (lambda data: data[:data.index(b"\n") + 1] + b"{not json\n" + data, "unreadable", "not a JSON object"),
    (lambda data: data[:-1000], "unreadable", "could not read"),
    (lambda data: data.replace(f'"torch": "{torch.__version__}"'.encode(), b'"torch": "1.0.0"'), "stale",
     "torch '1.0.0'"),
])
def test_a_damaged_or_foreign_cache_falls_back_to_compiling_with_a_warning(
        compiled_build: tuple[Path, BuildReport], mlp_file: Path, tmp_path: Path, empty_inductor_cache: None,
        caplog: pytest.LogCaptureFixture, damage: object, status: str, said: str) -> None:
    folder = copied_version(compiled_build[0], tmp_path)
    cache = folder / "1" / CACHE_FILENAME
    assert callable(damage)
    cache.write_bytes(damage(cache.read_bytes()))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)  # torch's own complaint about unreadable entries
        engine = kiln.load(folder)
    with engine:
        assert isinstance(engine, TorchEngine)
        assert engine.compile_cache is not None and engine.compile_cache.status == status
        assert engine.compile_counts is not None and engine.compile_counts.misses == 2  # compiled anew
        np.testing.assert_allclose(engine.infer({"INPUT0": X})["OUTPUT0"], reference(X, mlp_file), rtol=1e-4,
                                   atol=1e-5)
    assert any(said in record.getMessage() and "compiles the model anew" in record.getMessage()
               for record in caplog.records), [r.getMessage() for r in caplog.records]


def test_auto_on_the_cpu_compiles_nothing_and_says_why(mlp_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "mlp"
    report = build(mlp_file, out, BuildOptions(backend="torch", max_batch_size=4, progress=False))
    assert report.details["compile"]["requested"] == "auto" and report.details["compile"]["mode"] == "none"
    assert "a CPU build" in report.details["compile"]["decided_by"]
    assert report.details["gpu_limit"] == {"skipped": "a CPU build: there is no GPU to measure"}
    assert not (out / "1" / CACHE_FILENAME).exists()
    assert "compile_mode" not in (out / "config.pbtxt").read_text()


def test_auto_follows_an_existing_config(mlp_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "mlp"
    build(mlp_file, out, BuildOptions(backend="torch", max_batch_size=4, compile_mode="none", progress=False))
    report = build(mlp_file, out, BuildOptions(backend="torch", max_batch_size=4, progress=False))
    assert report.details["compile"] == {"requested": "auto", "mode": "none",
                                         "decided_by": "the model folder's config.pbtxt sets it"}


@pytest.mark.slow
def test_auto_times_the_eager_and_the_compiled_engine_and_keeps_the_faster(
        compiled_build: tuple[Path, BuildReport], mlp_file: Path, tmp_path: Path) -> None:
    """What auto does on a CUDA build, run on the CPU: the measurement and the record of it."""
    source = OnnxSource(mlp_file)
    file_io = source.file_io()
    report = BuildReport(model="mlp", source="test", output=str(tmp_path), version=1, backend="torch",
                         precision="fp32")
    options = BuildOptions(backend="torch", max_batch_size=4, progress=False)
    context = BuildContext(source=source, version_dir=tmp_path / "mlp" / "1", options=options, file_io=file_io,
                           samples=generate_samples(file_io.inputs, 8, {}, 0), max_batch_size=4,
                           progress=Progress(False), report=report)
    eager = BuildResult(backend="pytorch", platform="torch_aoti", file_io=file_io, max_batch_size=4)
    mode = choose(context, compiled_build[0] / "1" / "model.pt2", eager)
    details = report.details["compile"]
    assert details["mode"] == mode and details["decided_by"].startswith("measured: at batch 4")
    (timing,) = details["timings"]  # a CPU config has no preferred sizes: the largest batch
    assert timing["batch_size"] == 4 and timing["eager_ms"] > 0 and timing["compiled_ms"] > 0
    faster = timing["compiled_ms"] <= (1 - MIN_GAIN) * timing["eager_ms"]
    assert mode == ("default" if faster else "none")
    assert set(details["load_s"]) == {"eager", "compiled_cold"}
