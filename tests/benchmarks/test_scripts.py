"""Every maintained benchmark parses its command line and has a smoke test; the GPU-only ones run for real where
a CUDA device is (``gpu`` marker), on a shrunken ResNet-50 built for the torch backend."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import onnx
import pytest

from ._smoke import BENCHMARKS, SRC, cuda_available, read_json, run_main

SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.stem.startswith("_"))
HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_parses_help(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        with pytest.raises(SystemExit) as exited:
            run_main(script, "--help")
    except ModuleNotFoundError as exc:  # GPU scripts import torch at the top
        if exc.name != "torch":
            raise
        pytest.skip("needs torch (pip install 'kiln[torch]')")
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_has_a_smoke_test(script: str) -> None:
    tests = "".join(p.read_text() for p in HERE.glob("test_*.py"))
    assert f'run_main("{script}"' in tests or f'_script("{script}"' in tests, \
        f"benchmarks/{script}.py has no smoke test under tests/benchmarks/"


# GPU smoke tests: each GPU-only script in its own process (they set process-wide state), on a small model.

needs_cuda = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device; PyTorch sees none")


def _script(name: str, *argv: str, timeout: float = 600) -> str:
    """``python benchmarks/<name>.py ARGV``; its standard output."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)}
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *argv], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def gpu_repo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A repository holding ``resnet50`` built as the GPU benchmarks expect (torch backend, FP16, channels-last,
    CUDA graphs), shrunk to 8 base channels and 32x32 images."""
    from kiln.build import BuildOptions, build
    from kiln.demo.resnet import build_resnet50

    root = tmp_path_factory.mktemp("gpu")
    source = root / "resnet50.onnx"
    onnx.save(build_resnet50(0, base_channels=8, image_size=32, num_classes=10), str(source))
    build(source, root / "repo" / "resnet50", BuildOptions(backend="torch", device="cuda", precision="fp16",
                                                           channels_last=True, max_batch_size=8, samples=4,
                                                           min_top1=0.0,  # random, shrunken: classes nearly tie
                                                           compile_mode="none"))  # eager graphs: quick to load
    yield root / "repo"


@pytest.mark.gpu
@needs_cuda
def test_torch_gpu(tmp_path: Path) -> None:
    output = tmp_path / "torch_gpu.json"
    _script("torch_gpu", "--batch-sizes", "1,2", "--seconds", "0.2", "--base-channels", "8", "--image-size", "32",
            "--compile-mode", "none", "--min-top1", "0", "--output", str(output))
    rows = read_json(output)["rows"]
    assert {(r["engine"], r["batch"]) for r in rows} == {
        (engine, batch) for engine in ("eager fp32", "built fp16 + cuda graphs", "built, input on the GPU")
        for batch in (1, 2)}
    assert all(r["median_ms"] > 0 and r["images_per_s"] > 0 for r in rows), rows


@pytest.mark.gpu
@needs_cuda
def test_gpu_memory(gpu_repo: Path) -> None:
    out = _script("gpu_memory", str(gpu_repo / "resnet50"), "--graph-sizes", "1-2;1,2", "--batches", "1,2")
    loaded = [line for line in out.splitlines() if "loaded (" in line]
    assert len(loaded) == 2 and all(float(line.split()[-1].replace(",", "")) > 0 for line in loaded), out


@pytest.mark.gpu
@needs_cuda
def test_gpu_streams(gpu_repo: Path) -> None:
    out = _script("gpu_streams", "--repo", str(gpu_repo), "--batches", "2", "--streams", "1,2", "--seconds", "0.2")
    rates = [float(line.split(":")[1].split()[0].replace(",", "")) for line in out.splitlines() if "images/s" in line]
    assert len(rates) == 6 and all(rate > 0 for rate in rates), out


@pytest.mark.gpu
@needs_cuda
def test_pinned_rows(gpu_repo: Path, tmp_path: Path) -> None:
    output = tmp_path / "pinned.txt"
    _script("pinned_rows", "--repo", str(gpu_repo), "--batches", "2", "--rounds", "1", "--seconds", "0.2",
            "--output", str(output))
    rows = [line.split("|") for line in output.read_text().splitlines() if line.startswith("| 2 |")]
    assert sorted(row[3].strip() for row in rows) == ["in place, back to back", "in place, one copy per request",
                                                      "staged"]
    assert all(float(row[4].replace(",", "")) > 0 and float(row[6].replace(",", "")) > 0 for row in rows), rows


@pytest.mark.gpu
@needs_cuda
def test_gpu_direct_paths(gpu_repo: Path, tmp_path: Path) -> None:
    output = tmp_path / "direct.json"
    _script("gpu_direct_paths", "--repo", str(gpu_repo), "--seconds", "0.2", "--warmup", "0.1", "--output",
            str(output))
    rows = read_json(output)
    assert any(name.startswith("kiln engine.infer") for name in rows)
    assert any(name.startswith("plain PyTorch") for name in rows)
    assert all(row["requests_per_s"] > 0 for row in rows.values()), rows


@pytest.mark.gpu
@needs_cuda
def test_inprocess_gpu(gpu_repo: Path) -> None:
    out = _script("inprocess_gpu", str(gpu_repo), "--concurrency", "2", "--seconds", "0.3", "--warmup", "0.3",
                  "--instances", "1", "--preferred", "2", "--gpu-timing")
    (line,) = [line for line in out.splitlines() if " img/s" in line]
    assert float(line.split("c=2: ")[1].split()[0].replace(",", "")) > 0, out
    assert "gpu per batch" in out


@pytest.mark.gpu
@needs_cuda
def test_shm_gpu(gpu_repo: Path, tmp_path: Path) -> None:
    from kiln.server.cuda_ipc import unavailable_reason

    tensors = "request body,system shm" + ("" if unavailable_reason() else ",cuda shm")
    output = tmp_path / "shm.json"
    _script("shm_gpu", "--repo", str(gpu_repo), "--concurrency", "2", "--seconds", "0.3", "--client-processes", "1",
            "--tensors", tensors, "--output", str(output))
    rows = read_json(output)["rows"]
    assert {row["path"] for row in rows} >= {"direct engine.infer()", "kiln serve, http", "kiln serve, grpc"}
    assert all(row["requests_per_s"] > 0 for row in rows), rows
