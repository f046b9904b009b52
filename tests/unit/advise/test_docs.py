"""docs/advise.md shows real output: its examples are what `kiln advise` prints for the reference-shaped file."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from kiln.advise.run import run_advise
from kiln.cli import make_parser
from kiln.cli.advise import advise_options

DOCS = Path(__file__).resolve().parents[3] / "docs" / "advise.md"


def examples() -> list[tuple[list[str], str]]:
    blocks = re.findall(r"```\n\$ kiln advise (.*?)\n(.*?)```", DOCS.read_text(), re.DOTALL)
    return [(shlex.split(command), output) for command, output in blocks]


@pytest.fixture
def docs_compare(compare: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file the examples name: the reference shape, with the served c=16 row unstable."""
    compare["scenarios"][1]["results"][2]["stable"] = False
    monkeypatch.chdir(tmp_path)
    path = Path("compare.json")
    path.write_text(json.dumps(compare))
    return path


def test_the_docs_have_examples() -> None:
    assert len(examples()) == 2


@pytest.mark.parametrize(("argv", "expected"), examples())
def test_docs_example_output_is_current(docs_compare: Path, argv: list[str], expected: str) -> None:
    options = advise_options(make_parser().parse_args(["advise", *argv]))
    out = io.StringIO()
    assert run_advise(options, stdin=io.StringIO(), stdout=out, stderr=io.StringIO()) == 0
    assert out.getvalue() == expected


def test_docs_python_example_runs(docs_compare: Path) -> None:
    block = re.search(r"```python\n(.*?)```", DOCS.read_text(), re.DOTALL)
    assert block is not None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.group(1), str(DOCS), "exec"), {})
    assert out.getvalue() == "server ['latency-served-meets', 'several-models', 'frequent-updates', " \
        "'memory-server-saves']\n"
