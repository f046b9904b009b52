"""The routing policy: when an edge answer goes to the cloud, as data, and the pure decision over one request.

A decision is per request: the policy looks at every row of the batch, and when any row trips a criterion the
whole request is forwarded (the cloud answers or shadows the request as the client sent it). The reasons name the
criterion and the rows that tripped it.

Uncertainty is read from the classifier output: ``output`` names it, by default the first 2-D float output. With
``scores="auto"`` the output counts as probabilities when every value lies in [0, 1] and every row sums to 1
(within 1e-3); otherwise it is taken as logits and softmax is applied. ``"probabilities"`` and ``"logits"`` fix
the choice.

Range checks compare inputs with fixed per-input bounds, or with statistics of calibration samples (see
:mod:`kiln.edge.calibration`): per-feature min/max (``calibrated_range``) and a distance score (``max_distance``:
the root-mean-square z-score of a row, a diagonal Mahalanobis distance normalised by the number of features).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.edge.calibration import CalibrationStats, load_calibration
from kiln.errors import ConfigError, InvalidArgumentError

Array = npt.NDArray[Any]
Hook = Callable[[Mapping[str, Array], Mapping[str, Array]], str | None]
"""``hook(inputs, outputs)`` returns a reason to forward the request, or None."""

LOCAL_ONLY = "local-only"
CLOUD_FALLBACK = "cloud-fallback"
SHADOW = "shadow"
MODES = (LOCAL_ONLY, CLOUD_FALLBACK, SHADOW)
SCORES = ("auto", "probabilities", "logits")
_DISTRIBUTION_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Decision:
    forward: bool
    reasons: list[str]


@dataclass(frozen=True)
class Policy:
    """What makes the edge forward a request, and what forwarding means (``mode``)."""

    mode: str = CLOUD_FALLBACK
    output: str | None = None
    scores: str = "auto"
    max_prob_below: float | None = None
    margin_below: float | None = None
    entropy_above: float | None = None
    input_bounds: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    calibration: CalibrationStats | None = None
    max_distance: float | None = None
    calibrated_range: bool = False
    hook: Hook | None = None
    forward_on_error: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"edge policy: mode '{self.mode}' is not one of {', '.join(MODES)}")
        if self.scores not in SCORES:
            raise ConfigError(f"edge policy: scores '{self.scores}' is not one of {', '.join(SCORES)}")
        for name, (low, high) in self.input_bounds.items():
            if not low <= high:
                raise ConfigError(f"edge policy: input_bounds for '{name}' is [{low}, {high}]; expected min <= max")
        if (self.max_distance is not None or self.calibrated_range) and self.calibration is None:
            raise ConfigError("edge policy: max_distance and calibrated_range need calibration statistics "
                              "(calibration: a stats file written by kiln.edge.write_calibration)")

    @property
    def checks_uncertainty(self) -> bool:
        return any(v is not None for v in (self.max_prob_below, self.margin_below, self.entropy_above))


_FILE_KEYS = {f.name for f in dataclasses.fields(Policy)}


def policy_from_dict(doc: Mapping[str, Any], base_dir: Path | None = None) -> Policy:
    """A policy from the JSON document of a policy file; ``calibration`` is a path (relative to ``base_dir``)
    and ``hook`` a ``module:function`` name."""
    unknown = sorted(set(doc) - _FILE_KEYS)
    if unknown:
        raise ConfigError(f"edge policy: unknown key(s) {', '.join(unknown)}; "
                          f"expected: {', '.join(sorted(_FILE_KEYS))}")
    values = dict(doc)
    if values.get("calibration") is not None:
        path = Path(values["calibration"])
        values["calibration"] = load_calibration(path if base_dir is None or path.is_absolute() else base_dir / path)
    if values.get("hook") is not None:
        values["hook"] = load_hook(str(values["hook"]))
    if "input_bounds" in values:
        values["input_bounds"] = _bounds(values["input_bounds"])
    return Policy(**values)


def load_policy(path: Path) -> Policy:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"edge policy file {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"edge policy file {path}: expected a JSON object, got {type(doc).__name__}")
    return policy_from_dict(doc, path.parent)


def _bounds(value: object) -> dict[str, tuple[float, float]]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"edge policy: input_bounds must map input names to [min, max], got {value!r}")
    bounds: dict[str, tuple[float, float]] = {}
    for name, pair in value.items():
        if not isinstance(pair, Sequence) or len(pair) != 2:
            raise ConfigError(f"edge policy: input_bounds for '{name}' is {pair!r}; expected [min, max]")
        bounds[str(name)] = (float(pair[0]), float(pair[1]))
    return bounds


def load_hook(spec: str) -> Hook:
    """Import ``module:function``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"edge policy: hook '{spec}' is not of the form module:function")
    try:
        hook = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"edge policy: hook '{spec}' cannot be loaded ({exc})") from None
    if not callable(hook):
        raise ConfigError(f"edge policy: hook '{spec}' is not callable")
    result: Hook = hook
    return result


# -- the decision ------------------------------------------------------------------------------------------------


def decide(policy: Policy, inputs: Mapping[str, Array], outputs: Mapping[str, Array]) -> Decision:
    """Whether one request (all its rows) should go to the cloud, and why. Mode-independent."""
    reasons: list[str] = []
    if policy.checks_uncertainty:
        reasons += uncertainty_reasons(policy, outputs)
    reasons += range_reasons(policy, inputs)
    if policy.hook is not None:
        reasons += _hook_reasons(policy.hook, inputs, outputs)
    return Decision(bool(reasons), reasons)


def classifier_output(policy: Policy, outputs: Mapping[str, Array]) -> str:
    if policy.output is not None:
        if policy.output not in outputs:
            raise InvalidArgumentError(f"edge policy: output '{policy.output}' is not among the model's outputs "
                                       f"({', '.join(outputs)})")
        return policy.output
    for name, array in outputs.items():
        if array.ndim == 2 and np.issubdtype(array.dtype, np.floating):
            return name
    raise InvalidArgumentError(f"edge policy: uncertainty criteria need a 2-D float classifier output; outputs are "
                               f"{', '.join(f'{n} {a.dtype}{list(a.shape)}' for n, a in outputs.items())}")


def probabilities(scores: Array, mode: str = "auto") -> Array:
    """Rows as probability distributions: softmax of logits; distributions are kept as they are."""
    values = np.asarray(scores, dtype=np.float64)
    if mode == "probabilities" or (mode == "auto" and is_distribution(values)):
        return values
    shifted = values - values.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    result: Array = exp / exp.sum(axis=1, keepdims=True)
    return result


def is_distribution(values: Array) -> bool:
    if values.size == 0 or values.min() < 0.0 or values.max() > 1.0:
        return False
    return bool(np.all(np.abs(values.sum(axis=1) - 1.0) <= _DISTRIBUTION_TOLERANCE))


def uncertainty_reasons(policy: Policy, outputs: Mapping[str, Array]) -> list[str]:
    name = classifier_output(policy, outputs)
    probs = probabilities(outputs[name], policy.scores)
    reasons: list[str] = []
    top = np.sort(probs, axis=1)[:, ::-1]
    if policy.max_prob_below is not None:
        reasons += _rows(top[:, 0] < policy.max_prob_below, f"max probability of {name} below {policy.max_prob_below}")
    if policy.margin_below is not None and probs.shape[1] >= 2:
        reasons += _rows(top[:, 0] - top[:, 1] < policy.margin_below, f"top-2 margin of {name} below "
                                                                      f"{policy.margin_below}")
    if policy.entropy_above is not None:
        entropy = -np.sum(probs * np.log(np.clip(probs, 1e-12, 1.0)), axis=1)
        reasons += _rows(entropy > policy.entropy_above, f"entropy of {name} above {policy.entropy_above} nats")
    return reasons


def range_reasons(policy: Policy, inputs: Mapping[str, Array]) -> list[str]:
    reasons: list[str] = []
    for name, (low, high) in policy.input_bounds.items():
        if name not in inputs:
            raise InvalidArgumentError(f"edge policy: input_bounds names input '{name}', which the request lacks "
                                       f"(inputs: {', '.join(inputs)})")
        rows = _per_row(inputs[name])
        reasons += _rows((rows < low).any(axis=1) | (rows > high).any(axis=1), f"{name} outside [{low}, {high}]")
    stats = policy.calibration
    if stats is None:
        return reasons
    for name, stat in stats.inputs.items():
        if name not in inputs:
            continue  # a statistics file may cover inputs this model does not have
        rows = _per_row(inputs[name])
        if rows.shape[1] != stat.mean.size:
            raise InvalidArgumentError(f"edge policy: calibration statistics of '{name}' have {stat.mean.size} "
                                       f"features per row; the request has {rows.shape[1]}")
        if policy.calibrated_range:
            outside = (rows < stat.minimum).any(axis=1) | (rows > stat.maximum).any(axis=1)
            reasons += _rows(outside, f"{name} outside the calibrated range")
        if policy.max_distance is not None:
            distance = np.sqrt(np.mean(((rows - stat.mean) / stat.std) ** 2, axis=1))
            reasons += _rows(distance > policy.max_distance, f"{name} distance from calibration above "
                                                             f"{policy.max_distance}")
    return reasons


def _per_row(array: Array) -> Array:
    """Rows as [N, features] float64: the first axis is the batch axis."""
    values = np.asarray(array, dtype=np.float64)
    return values.reshape(values.shape[0] if values.ndim else 1, -1)


def _rows(mask: npt.ArrayLike, what: str) -> list[str]:
    rows = np.flatnonzero(np.asarray(mask))
    if rows.size == 0:
        return []
    shown = ", ".join(str(r) for r in rows[:8]) + (", ..." if rows.size > 8 else "")
    return [f"{what} (row{'s' if rows.size > 1 else ''} {shown})"]


def _hook_reasons(hook: Hook, inputs: Mapping[str, Array], outputs: Mapping[str, Array]) -> list[str]:
    # A broken hook must not fail the request: its error becomes a reason to ask the cloud.
    try:
        reason = hook(inputs, outputs)
    except Exception as exc:
        return [f"hook failed: {type(exc).__name__}: {exc}"]
    return [f"hook: {reason}"] if reason else []
