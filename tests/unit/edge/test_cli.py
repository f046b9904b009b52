"""``kiln edge`` flags: policy from flags and from a file (flags win), bounds parsing, ``kiln edge calibrate``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from kiln.edge.__main__ import main
from kiln.edge.cli import add_edge_arguments, parse_bounds, policy_from_args
from kiln.errors import ConfigError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_edge_arguments(parser)
    return parser.parse_args(["model.onnx", *argv])


def test_defaults_are_a_cloud_fallback_policy_with_no_criteria_on_loopback() -> None:
    args = parse()
    policy = policy_from_args(args)
    assert policy.mode == "cloud-fallback" and not policy.checks_uncertainty and policy.forward_on_error
    assert (args.host, args.port, args.cloud_url) == ("127.0.0.1", 8000, None)


def test_flags_override_the_policy_file(tmp_path: Path) -> None:
    (tmp_path / "policy.json").write_text(json.dumps({"mode": "shadow", "max_prob_below": 0.3, "margin_below": 0.2,
                                                      "input_bounds": {"A": [0, 1]}}))
    args = parse("--policy", str(tmp_path / "policy.json"), "--max-prob-below", "0.6", "--input-bounds",
                 "B:-1,2.5", "--no-forward-on-error", "--hook", "kiln.edge.policy:decide")
    policy = policy_from_args(args)
    assert policy.mode == "shadow" and policy.max_prob_below == 0.6 and policy.margin_below == 0.2
    assert policy.input_bounds == {"A": (0.0, 1.0), "B": (-1.0, 2.5)}
    assert not policy.forward_on_error and policy.hook is not None


def test_bounds_parsing() -> None:
    assert parse_bounds("input:0:0,255") == ("input:0", (0.0, 255.0))
    for text in ("X", "X:1", "X:a,b", ":0,1"):
        with pytest.raises(ConfigError, match="NAME:MIN,MAX"):
            parse_bounds(text)


def test_calibrate_command_writes_stats_the_policy_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.savez(tmp_path / "samples.npz", INPUT0=np.random.default_rng(0).standard_normal((50, 64)))
    assert main(["calibrate", str(tmp_path / "samples.npz"), "-o", str(tmp_path / "stats.npz")]) == 0
    assert "INPUT0: 64 features" in capsys.readouterr().out
    policy = policy_from_args(parse("--calibration", str(tmp_path / "stats.npz"), "--max-distance", "3"))
    assert policy.calibration is not None and policy.calibration.inputs["INPUT0"].mean.shape == (64,)


def test_errors_are_reported_not_raised(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "absent.onnx"), "--mode", "local-only"]) == 1
    assert "kiln edge: error:" in capsys.readouterr().err
