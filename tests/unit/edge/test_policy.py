"""The routing policy: each criterion, row by row, and the policy as data (JSON file, validation)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.edge.calibration import compute_calibration
from kiln.edge.policy import (
    Policy,
    classifier_output,
    decide,
    is_distribution,
    load_policy,
    policy_from_dict,
    probabilities,
)
from kiln.errors import ConfigError, InvalidArgumentError

# Row 0 is confident (one large logit), row 1 a near tie between two classes, row 2 flat over four classes.
LOGITS = np.array([[8.0, 0.0, 0.0, 0.0], [2.0, 1.9, -3.0, -3.0], [0.0, 0.0, 0.0, 0.0]], dtype=np.float32)
X = np.zeros((3, 4), dtype=np.float32)


def outputs(scores: np.ndarray) -> dict[str, np.ndarray]:
    return {"LABEL": np.array([1, 2, 3], dtype=np.int64), "SCORES": scores}


def test_logits_get_softmax_and_distributions_stay_as_they_are() -> None:
    probs = probabilities(LOGITS)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-9)
    assert probs[0, 0] > 0.99 and probs[2, 0] == pytest.approx(0.25)
    already = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    assert is_distribution(already)
    np.testing.assert_array_equal(probabilities(already), already)


def test_scores_setting_overrides_detection() -> None:
    looks_like_probs = np.array([[0.5, 0.5]])
    np.testing.assert_allclose(probabilities(looks_like_probs, "logits"), [[0.5, 0.5]])
    not_normalised = np.array([[0.2, 0.1]])
    assert not is_distribution(not_normalised)
    np.testing.assert_array_equal(probabilities(not_normalised, "probabilities"), not_normalised)
    assert not is_distribution(np.array([[1.5, -0.5]]))  # sums to 1, but not probabilities


def test_default_classifier_output_is_the_first_2d_float_output() -> None:
    assert classifier_output(Policy(), outputs(LOGITS)) == "SCORES"
    assert classifier_output(Policy(output="SCORES"), outputs(LOGITS)) == "SCORES"
    with pytest.raises(InvalidArgumentError, match="'NOPE' is not among"):
        classifier_output(Policy(output="NOPE"), outputs(LOGITS))
    with pytest.raises(InvalidArgumentError, match="2-D float"):
        decide(Policy(max_prob_below=0.5), {}, {"LABEL": np.array([1])})


@pytest.mark.parametrize(("criterion", "rows"), [
    ({"max_prob_below": 0.6}, "rows 1, 2"),
    ({"margin_below": 0.1}, "rows 1, 2"),
    ({"entropy_above": 1.0}, "row 2"),
])
def test_uncertainty_criteria_name_the_rows_they_flag(criterion: dict[str, float], rows: str) -> None:
    decision = decide(Policy(**criterion), {"X": X}, outputs(LOGITS))
    assert decision.forward
    assert len(decision.reasons) == 1 and decision.reasons[0].endswith(f"({rows})")


def test_confident_rows_are_not_forwarded() -> None:
    policy = Policy(max_prob_below=0.6, margin_below=0.1, entropy_above=1.0)
    decision = decide(policy, {"X": X[:1]}, outputs(LOGITS[:1]))
    assert decision == decide(policy, {"X": X[:1]}, outputs(LOGITS[:1]))
    assert not decision.forward and decision.reasons == []


def test_one_uncertain_row_forwards_the_whole_request_with_each_criterion_listed() -> None:
    decision = decide(Policy(max_prob_below=0.6, entropy_above=1.0), {"X": X}, outputs(LOGITS))
    assert decision.forward
    assert [r.split(" (")[0] for r in decision.reasons] == ["max probability of SCORES below 0.6",
                                                             "entropy of SCORES above 1.0 nats"]


def test_input_bounds_check_every_element_per_row() -> None:
    inputs = {"X": np.array([[0.0, 0.5], [0.0, 1.5], [-2.0, 0.0]])}
    decision = decide(Policy(input_bounds={"X": (-1.0, 1.0)}), inputs, outputs(LOGITS))
    assert decision.reasons == ["X outside [-1.0, 1.0] (rows 1, 2)"]
    with pytest.raises(InvalidArgumentError, match="input 'Y'"):
        decide(Policy(input_bounds={"Y": (0.0, 1.0)}), inputs, {})


def calibration_samples() -> np.ndarray:
    return np.random.default_rng(0).normal([0.0, 10.0, -5.0], [1.0, 2.0, 0.5], size=(500, 3))


def test_distance_from_calibration_flags_far_rows_only() -> None:
    stats = compute_calibration({"X": calibration_samples()})
    near, far = [0.1, 10.5, -5.1], [4.0, 18.0, -7.0]
    decision = decide(Policy(calibration=stats, max_distance=3.0), {"X": np.array([near, far])}, {})
    assert decision.reasons == ["X distance from calibration above 3.0 (row 1)"]


def test_calibrated_range_uses_per_feature_min_max() -> None:
    samples = calibration_samples()
    stats = compute_calibration({"X": samples})
    inside = samples[:2]
    outside = samples[:1].copy()
    outside[0, 2] = samples[:, 2].max() + 0.01  # one feature past its own maximum, well within the others' range
    policy = Policy(calibration=stats, calibrated_range=True)
    assert not decide(policy, {"X": inside}, {}).forward
    assert decide(policy, {"X": np.concatenate([inside, outside])}, {}).reasons == [
        "X outside the calibrated range (row 2)"]


def test_calibration_feature_count_must_match() -> None:
    stats = compute_calibration({"X": calibration_samples()})
    with pytest.raises(InvalidArgumentError, match="3 features per row; the request has 2"):
        decide(Policy(calibration=stats, max_distance=3.0), {"X": np.zeros((1, 2))}, {})


def test_hook_reason_forwards_and_a_failing_hook_forwards_too() -> None:
    def second_class(inputs: Mapping[str, Any], outs: Mapping[str, Any]) -> str | None:
        return "label 2 seen" if 2 in outs["LABEL"] else None

    def broken(inputs: Mapping[str, Any], outs: Mapping[str, Any]) -> str | None:
        raise KeyError("missing")

    assert decide(Policy(hook=second_class), {"X": X}, outputs(LOGITS)).reasons == ["hook: label 2 seen"]
    assert not decide(Policy(hook=second_class), {"X": X}, {"LABEL": np.array([1])}).forward
    assert decide(Policy(hook=broken), {"X": X}, outputs(LOGITS)).reasons == ["hook failed: KeyError: 'missing'"]


def test_policy_rejects_bad_values() -> None:
    with pytest.raises(ConfigError, match="mode 'cloud-only'"):
        Policy(mode="cloud-only")
    with pytest.raises(ConfigError, match="scores 'odds'"):
        Policy(scores="odds")
    with pytest.raises(ConfigError, match=r"\[2.0, 1.0\]"):
        Policy(input_bounds={"X": (2.0, 1.0)})
    with pytest.raises(ConfigError, match="need calibration statistics"):
        Policy(max_distance=2.0)


def reason_hook(inputs: Mapping[str, Any], outs: Mapping[str, Any]) -> str | None:
    return "always"


def test_policy_file_with_calibration_path_and_hook(tmp_path: Path) -> None:
    np.savez(tmp_path / "samples.npz", X=calibration_samples())
    from kiln.edge.calibration import write_calibration

    write_calibration(tmp_path / "samples.npz", tmp_path / "stats.npz")
    doc = {"mode": "shadow", "max_prob_below": 0.4, "input_bounds": {"X": [-100, 100]},
           "calibration": "stats.npz", "max_distance": 4, "hook": f"{__name__}:reason_hook"}
    (tmp_path / "policy.json").write_text(json.dumps(doc))
    policy = load_policy(tmp_path / "policy.json")
    assert policy.mode == "shadow" and policy.input_bounds == {"X": (-100.0, 100.0)}
    assert policy.calibration is not None and policy.hook is reason_hook
    assert decide(policy, {"X": X[:, :3]}, outputs(LOGITS[:, :3])).reasons[-1] == "hook: always"


def test_policy_file_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown key"):
        policy_from_dict({"max_prob": 0.5})
    with pytest.raises(ConfigError, match="module:function"):
        policy_from_dict({"hook": "no_colon"})
    with pytest.raises(ConfigError, match="cannot be loaded"):
        policy_from_dict({"hook": "kiln.edge.policy:no_such_function"})
    with pytest.raises(ConfigError, match="expected \\[min, max\\]"):
        policy_from_dict({"input_bounds": {"X": [1]}})
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        load_policy(tmp_path / "list.json")
    with pytest.raises(ConfigError, match="absent.json"):
        load_policy(tmp_path / "absent.json")
