"""Everything ``kiln edge`` takes, declared once: each field is an option with its flag (kiln/_flags.py).

The routing fields left at None take their value from the ``--policy`` file, or the Policy default: a flag given
on the command line overrides the same field of the file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln._flags import flag
from kiln.edge.calibration import load_calibration
from kiln.edge.policy import MODES, SCORES, Policy, load_hook, load_policy
from kiln.errors import ConfigError

# The Policy fields a flag of the same name overrides as it is.
_POLICY_FIELDS = ("mode", "output", "scores", "max_prob_below", "margin_below", "entropy_above", "max_distance",
                  "calibrated_range", "forward_on_error")


@dataclass(frozen=True)
class EdgeOptions:
    model: Path = field(metadata=flag(help="a model file (.onnx) or model folder (<repository>/<model>)"))
    model_version: int | None = field(default=None, metadata=flag(
        "--model-version", help="version folder to load (default: newest)"))
    cloud_url: str | None = field(default=None, metadata=flag(
        "--cloud-url", metavar="HOST:PORT", help="KServe V2 HTTP address of the cloud kiln server, host:port or "
                                                 "http(s)://host:port (needed unless --mode local-only)"))
    cloud_ca: Path | None = field(default=None, metadata=flag(
        "--cloud-ca", metavar="CA", help="https cloud url: verify the server against this CA (default: the "
                                         "system's CAs)"))
    cloud_cert: Path | None = field(default=None, metadata=flag(
        "--cloud-cert", metavar="CERT", help="https cloud url: client certificate for mTLS (PEM)"))
    cloud_key: Path | None = field(default=None, metadata=flag(
        "--cloud-key", metavar="KEY", help="https cloud url: the private key of --cloud-cert (default: inside the "
                                           "cert file)"))
    cloud_model: str | None = field(default=None, metadata=flag(
        "--cloud-model", help="the model's name on the cloud (default: the same)"))
    cloud_version: str = field(default="", metadata=flag(
        "--cloud-version", help="the model version to ask on the cloud (default: the cloud's choice)"))
    cloud_timeout_s: float = field(default=5.0, metadata=flag(
        "--cloud-timeout-s", help="socket timeout of cloud requests: connect and each read (default 5 s)"))
    policy_file: Path | None = field(default=None, metadata=flag(
        "--policy", metavar="FILE", help="routing policy JSON file"))
    mode: str | None = field(default=None, metadata=flag("--mode", choices=MODES, help="default: cloud-fallback"))
    output: str | None = field(default=None, metadata=flag(
        "--output", help="classifier output to judge (default: first 2-D float one)"))
    scores: str | None = field(default=None, metadata=flag(
        "--scores", choices=SCORES, help="how to read the classifier output (default auto: softmax unless rows are "
                                         "already distributions)"))
    max_prob_below: float | None = field(default=None, metadata=flag(
        "--max-prob-below", help="forward when max probability < P"))
    margin_below: float | None = field(default=None, metadata=flag(
        "--margin-below", help="forward when top-1 minus top-2 < M"))
    entropy_above: float | None = field(default=None, metadata=flag(
        "--entropy-above", help="forward when entropy (nats) > H"))
    input_bounds: tuple[str, ...] = field(default=(), metadata=flag(  # NAME:MIN,MAX texts, see parse_bounds
        "--input-bounds", metavar="NAME:MIN,MAX",
        help="forward when an element of input NAME lies outside [MIN, MAX] (repeatable)"))
    calibration: Path | None = field(default=None, metadata=flag(
        "--calibration", metavar="STATS.npz", help="calibration statistics (kiln edge calibrate)"))
    max_distance: float | None = field(default=None, metadata=flag(
        "--max-distance", help="forward when a row's RMS z-score from the calibration statistics exceeds D"))
    calibrated_range: bool | None = field(default=None, metadata=flag(
        "--calibrated-range", form="switch",
        help="forward when a feature lies outside the calibration samples' min/max"))
    hook: str | None = field(default=None, metadata=flag(
        "--hook", metavar="MODULE:FUNCTION", help="hook(inputs, outputs) returning a reason to forward, or None"))
    forward_on_error: bool | None = field(default=None, metadata=flag(
        "--no-forward-on-error", form="negated_switch",
        help="let a local engine failure fail the request instead of asking the cloud"))
    shadow_workers: int = field(default=2, metadata=flag(
        "--shadow-workers", help="threads sending shadow copies (default 2)"))
    shadow_queue: int = field(default=64, metadata=flag(
        "--shadow-queue", help="shadow copies waiting at most; more are dropped and counted (default 64)"))
    sync_interval_s: float = field(default=0.0, metadata=flag(
        "--sync-interval-s", help="poll the cloud for a newer version of the model every S seconds (0 = off; needs "
                                  "kiln serve --allow-model-download on the cloud)"))
    cloud_api_key: str | None = field(default=None, metadata=flag(
        "--cloud-api-key", env="KILN_API_KEY", metavar="KEY",
        help="API key sent to the cloud as a bearer token (default: env KILN_API_KEY)"))
    model_dir: Path | None = field(default=None, metadata=flag(
        "--model-dir", help="model folder that receives synced versions (default: the model folder given)"))
    probation_requests: int = field(default=20, metadata=flag(
        "--probation-requests",
        help="a synced version's first N local runs; an engine error among them rolls it back"))
    capture: bool = field(default=False, metadata=flag(
        "--capture", form="switch",
        help="keep forwarded requests (inputs, local and cloud outputs, reason) in <model-dir>/.kiln-capture-queue "
             "and upload them to the cloud's capture store (needs kiln serve --capture-dir on the cloud)"))
    host: str = field(default="127.0.0.1", metadata=flag("--host", help="address to listen on (default 127.0.0.1)"))
    port: int = field(default=8000, metadata=flag("--port", help="HTTP port (default 8000)"))

    def policy(self) -> Policy:
        """The --policy file's policy (or the default one) with the routing flags given here applied over it."""
        policy = load_policy(self.policy_file) if self.policy_file is not None else Policy()
        changes: dict[str, Any] = {name: getattr(self, name) for name in _POLICY_FIELDS
                                   if getattr(self, name) is not None}
        if self.input_bounds:
            changes["input_bounds"] = {**policy.input_bounds, **dict(parse_bounds(text) for text in self.input_bounds)}
        if self.calibration is not None:
            changes["calibration"] = load_calibration(self.calibration)
        if self.hook is not None:
            changes["hook"] = load_hook(self.hook)
        return dataclasses.replace(policy, **changes)


def parse_bounds(text: str) -> tuple[str, tuple[float, float]]:
    """``NAME:MIN,MAX`` (the name may hold colons: the last one separates it)."""
    name, sep, pair = text.rpartition(":")
    parts = pair.split(",")
    try:
        if not sep or not name or len(parts) != 2:
            raise ValueError
        return name, (float(parts[0]), float(parts[1]))
    except ValueError:
        raise ConfigError(f"--input-bounds '{text}' is not of the form NAME:MIN,MAX") from None
