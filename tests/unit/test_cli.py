"""The `kiln` command's wiring: every command is reachable and errors become `kiln: error: ...` with status 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.cli import main


@pytest.mark.parametrize("command", [["demo-repo"], ["config"], ["serve"], ["build"], ["bench"], ["bench-compare"],
                                     ["bench", "compare"], ["advise"], ["edge"], ["edge", "calibrate"],
                                     ["edge-calibrate"], ["capture"], ["capture", "export"]])
def test_every_command_has_help(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    assert "usage: kiln" in capsys.readouterr().out


def test_bench_compare_is_an_alias_and_reports_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere"
    assert main(["bench", "compare", "simple", "--model-repository", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kiln: error: ") and str(missing) in err


def test_gil_switch_interval_is_set_and_checked() -> None:
    import sys

    from kiln.cli import set_switch_interval
    from kiln.errors import InvalidArgumentError

    before = sys.getswitchinterval()
    try:
        set_switch_interval(500)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        with pytest.raises(InvalidArgumentError, match="--gil-switch-interval-us must be a positive number of "
                                                       "microseconds, got 0"):
            set_switch_interval(0)
    finally:
        sys.setswitchinterval(before)
