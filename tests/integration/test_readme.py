"""The README's direct-path example runs as written (after `kiln demo-repo ./models`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_direct_example_runs(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme.splitlines()[3].startswith("make serve") and readme.splitlines()[4].startswith("make test")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    demo = subprocess.run([sys.executable, "-m", "kiln.cli", "demo-repo", "./models"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env)
    assert demo.returncode == 0, demo.stderr
    block = re.search(r"```python\n(.*?)```", readme, re.DOTALL)
    assert block is not None
    run = subprocess.run([sys.executable, "-c", block.group(1)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert "INPUT0" in run.stdout and "[[ 0  2  4" in run.stdout
