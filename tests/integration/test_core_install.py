"""`pip install kiln` alone (no extras) gives a working direct engine: the edge-device install."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import importlib.util, sys
    import numpy as np
    import kiln
    from kiln.demo import build_demo_repository

    for server_only in ("starlette", "uvicorn", "grpc", "prometheus_client"):
        assert importlib.util.find_spec(server_only) is None, server_only + " came with the core install"
    build_demo_repository(sys.argv[1])
    with kiln.load(sys.argv[1] + "/simple") as engine:
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        out = engine.infer({"INPUT0": a, "INPUT1": a})
    assert (out["OUTPUT0"] == 2 * a).all() and (out["OUTPUT1"] == 0).all()
    # An edge device talks to its cloud with kiln's V2 client, which needs nothing beyond the core install.
    from kiln.edge import EdgeRunner, Policy
    from kiln.v2.client import HttpClient, ServerUnreachableError
    with EdgeRunner(sys.argv[1] + "/simple", None, Policy(mode="local-only")) as edge:
        assert (edge.infer({"INPUT0": a, "INPUT1": a}).outputs["OUTPUT0"] == 2 * a).all()
    try:
        HttpClient("127.0.0.1:9", timeout_s=1).ready()
    except ServerUnreachableError:
        pass
    print("core install ok")
""")


def test_core_install_runs_direct_engine(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(ROOT)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout + install.stderr
    run = subprocess.run([str(python), "-c", SCRIPT, str(tmp_path / "repo")], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "core install ok" in run.stdout
    assert sys.version_info >= (3, 10)
