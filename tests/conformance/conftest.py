"""`kiln serve` in a subprocess on free ports, over a repository with the demo models plus a few test models."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.demo import build_demo_repository
from kiln.testing.serve import KilnProcess, kiln_serve

MAX_INPUT_SIZE = 1 << 20  # small, so the oversized-body test stays cheap

IDENTITY_CONFIG = """
backend: "identity"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: {dtype} dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: {dtype} dims: [ -1 ] }} ]
"""


def build_conformance_repository(root: Path) -> Path:
    build_demo_repository(root)
    for name, dtype in (("identity_bytes", "TYPE_STRING"), ("identity_fp16", "TYPE_FP16")):
        (root / name / "1").mkdir(parents=True, exist_ok=True)
        (root / name / "config.pbtxt").write_text(IDENTITY_CONFIG.format(dtype=dtype))
    labeled = root / "mlp_labeled"
    shutil.copytree(root / "mlp", labeled, dirs_exist_ok=True)
    config = (labeled / "config.pbtxt").read_text().replace('name: "mlp"', 'name: "mlp_labeled"')
    labeled_output = 'name: "OUTPUT0" label_filename: "labels.txt"'
    (labeled / "config.pbtxt").write_text(config.replace('name: "OUTPUT0"', labeled_output))
    (labeled / "labels.txt").write_text("".join(f"class_{i}\n" for i in range(10)))
    return root


@pytest.fixture(scope="session")
def kiln_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = build_conformance_repository(tmp_path_factory.mktemp("repo"))
    log_path = tmp_path_factory.mktemp("log") / "kiln.log"
    with kiln_serve([repo], "--http-max-input-size", str(MAX_INPUT_SIZE), "--exit-timeout-secs", "5",
                    log_path=log_path) as server:
        yield server


@pytest.fixture(scope="module")
def shm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    """`kiln serve` on the demo repository with client shared memory allowed (system and, where it can, CUDA)."""
    repo = tmp_path_factory.mktemp("shm-repo")
    build_demo_repository(repo)
    with kiln_serve([repo], "--allow-client-shm", "true", "--exit-timeout-secs", "5") as server:
        yield server
