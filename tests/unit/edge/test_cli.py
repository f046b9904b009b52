"""``kiln edge`` flags: policy from flags and from a file (flags win), bounds parsing, ``kiln edge calibrate``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kiln.cli import edge as cli_edge
from kiln.cli import main, make_parser
from kiln.edge.options import EdgeOptions, parse_bounds
from kiln.errors import ConfigError


def parse(*argv: str) -> EdgeOptions:
    """The options `kiln edge model.onnx ARGV` runs with."""
    return cli_edge.edge_options(make_parser().parse_args(["edge", "model.onnx", *argv]))


def test_defaults_are_a_cloud_fallback_policy_with_no_criteria_on_loopback() -> None:
    options = parse()
    policy = options.policy()
    assert policy.mode == "cloud-fallback" and not policy.checks_uncertainty and policy.forward_on_error
    assert (options.host, options.port, options.cloud_url) == ("127.0.0.1", 8000, None)
    assert options.model == Path("model.onnx")


def test_flags_override_the_policy_file(tmp_path: Path) -> None:
    (tmp_path / "policy.json").write_text(json.dumps({"mode": "shadow", "max_prob_below": 0.3, "margin_below": 0.2,
                                                      "input_bounds": {"A": [0, 1]}}))
    options = parse("--policy", str(tmp_path / "policy.json"), "--max-prob-below", "0.6", "--input-bounds",
                    "B:-1,2.5", "--no-forward-on-error", "--hook", "kiln.edge.policy:decide")
    policy = options.policy()
    assert policy.mode == "shadow" and policy.max_prob_below == 0.6 and policy.margin_below == 0.2
    assert policy.input_bounds == {"A": (0.0, 1.0), "B": (-1.0, 2.5)}
    assert not policy.forward_on_error and policy.hook is not None


def test_bounds_parsing() -> None:
    assert parse_bounds("input:0:0,255") == ("input:0", (0.0, 255.0))
    for text in ("X", "X:1", "X:a,b", ":0,1"):
        with pytest.raises(ConfigError, match="NAME:MIN,MAX"):
            parse_bounds(text)


@pytest.mark.parametrize("command", [["edge", "calibrate"], ["edge-calibrate"]])
def test_calibrate_command_writes_stats_the_policy_reads(command: list[str], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    np.savez(tmp_path / "samples.npz", INPUT0=np.random.default_rng(0).standard_normal((50, 64)))
    assert main([*command, str(tmp_path / "samples.npz"), "-o", str(tmp_path / "stats.npz")]) == 0
    assert "INPUT0: 64 features" in capsys.readouterr().out
    policy = parse("--calibration", str(tmp_path / "stats.npz"), "--max-distance", "3").policy()
    assert policy.calibration is not None and policy.calibration.inputs["INPUT0"].mean.shape == (64,)


def test_a_model_named_like_no_subcommand_is_the_edge_model() -> None:
    args = make_parser().parse_args(["edge", "calibrated.onnx", "--port", "9000"])
    assert args.run is cli_edge.run_edge
    assert cli_edge.edge_options(args).model == Path("calibrated.onnx")


def test_errors_are_reported_not_raised(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["edge", str(tmp_path / "absent.onnx"), "--mode", "local-only"]) == 1
    assert "kiln: error:" in capsys.readouterr().err
