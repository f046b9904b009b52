"""`kiln advise` flags and output, text and JSON, through the command's parser + run_advise."""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kiln.advise.rules import RULES
from kiln.advise.run import run_advise
from kiln.cli import make_parser
from kiln.cli.advise import advise_options
from kiln.errors import InvalidArgumentError


class Terminal(io.StringIO):
    """A stdin that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def parse(argv: list[str]) -> argparse.Namespace:
    return make_parser().parse_args(["advise", *argv])


def run(argv: list[str], stdin: io.StringIO | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run_advise(advise_options(parse(argv)), stdin=stdin or io.StringIO(), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_text_answer_with_flags() -> None:
    code, out, err = run(["--latency-budget-ms", "10", "--models", "3", "--update-frequency", "weekly"])
    assert code == 0 and err == ""
    assert out.startswith("recommendation: hybrid: the direct engine on the latency-critical path")
    assert "[latency-tight] direct:" in out and "[several-models] server:" in out and "assumed" not in out


def test_json_answer_with_evidence(compare: dict[str, Any], write_compare: Callable[[object], Path]) -> None:
    path = write_compare(compare)
    code, out, _ = run(["--latency-budget-ms", "10", "--models", "3", "--concurrency", "8", "--evidence", str(path),
                        "--update-frequency", "never", "--json"])
    data = json.loads(out)
    assert code == 0 and data["verdict"] == "server"
    assert [reason["rule"] for reason in data["reasons"]] == ["latency-served-meets", "several-models",
                                                            "memory-server-saves"]
    assert data["overridden"] == ["latency-tight"]
    assert data["evidence"]["file"] == str(path) and data["evidence"]["model"] == "resnet50"
    assert data["assumed"] == []
    assert [layer["role"] for layer in data["plan"]] == ["front-line services", "monitoring"]


def test_no_flags_without_a_terminal_uses_defaults_and_says_so() -> None:
    code, out, _ = run([])
    assert code == 0
    assert out.startswith("recommendation: direct")
    assert "  assumed: no latency budget (--latency-budget-ms not given)" in out
    assert "  assumed: 1 model (--models not given)" in out


def test_a_terminal_is_asked_on_stderr_and_json_stays_clean() -> None:
    code, out, err = run(["--json"], stdin=Terminal("8\n2\n\n"))
    data = json.loads(out)
    assert code == 0 and data["verdict"] == "hybrid" and data["assumed"] == []
    assert data["inputs"]["models"] == 2
    assert "p99 latency budget in ms" in err


def test_no_input_never_asks() -> None:
    _, out, err = run(["--no-input"], stdin=Terminal("8\n2\n\n"))
    assert err == "" and "assumed: no latency budget" in out


def test_rules_prints_the_table() -> None:
    _, out, _ = run(["--rules"])
    assert all(rule.id in out for rule in RULES)
    _, out, _ = run(["--rules", "--json"])
    assert [row["id"] for row in json.loads(out)] == [rule.id for rule in RULES]


@pytest.mark.parametrize("argv", [
    ["--latency-budget-ms", "fast"], ["--latency-budget-ms", "-1"], ["--models", "0"], ["--models", "two"],
    ["--update-frequency", "yearly"], ["--concurrency", "0"],
])
def test_bad_flag_values_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_budget_none_is_an_explicit_answer() -> None:
    _, out, _ = run(["--latency-budget-ms", "none", "--models", "1", "--update-frequency", "never"])
    assert "inputs: no latency budget" in out and "assumed" not in out


def test_a_bad_evidence_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    path.write_text('{"model": "simple", "results": []}')
    with pytest.raises(InvalidArgumentError, match="has no 'scenarios'"):
        run(["--evidence", str(path)])
