"""A/B routing: split a model's traffic across its loaded versions by weight, sticky per request key.

A model's config sets the starting point with ``parameters`` (all string values)::

    kiln.ab.weights       "1:90,2:10"  version:weight pairs; unlisted versions get no routed traffic
    kiln.ab.key           request parameter that holds the sticky key (default "routing_key")
    kiln.shadow.version   a version that receives a mirrored copy of some requests (shadow.py)
    kiln.shadow.fraction  the share of requests mirrored, 0..1
    kiln.shadow.atol      absolute / relative tolerance of the agreement check (default 1e-3 each)
    kiln.shadow.rtol

Only requests that name no version are routed. A request with a key goes to the version that wins weighted
rendezvous hashing of (key, version), so one key always meets the same version and a weight change moves only the
keys it has to; a request without a key draws a version at random by weight. Listed versions that are not loaded are
skipped (the others' weights renormalise); with none of them loaded, or without weights, the newest ready version
serves, as it does for any model. Weights and shadow settings can change at run time (:meth:`ModelRouting.update`);
they replace the config's until the model is reloaded with different ``kiln.*`` parameters.
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
from collections import deque
from collections.abc import Container, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kiln.config.spec import ModelSpec
from kiln.errors import InvalidArgumentError
from kiln.server.shadow import DEFAULT_ATOL, DEFAULT_RTOL, Shadow, ShadowStats

WEIGHTS = "kiln.ab.weights"
KEY = "kiln.ab.key"
SHADOW_VERSION = "kiln.shadow.version"
SHADOW_FRACTION = "kiln.shadow.fraction"
SHADOW_ATOL = "kiln.shadow.atol"
SHADOW_RTOL = "kiln.shadow.rtol"
KNOWN_PARAMETERS = (WEIGHTS, KEY, SHADOW_VERSION, SHADOW_FRACTION, SHADOW_ATOL, SHADOW_RTOL)
DEFAULT_KEY = "routing_key"
LATENCY_RESERVOIR = 2048
"""Recent request latencies kept per version for the percentiles of :meth:`ModelRouting.status`."""


@dataclass(frozen=True)
class RoutingConfig:
    """The ``kiln.*`` parameters of one model, checked."""

    weights: Mapping[int, float] = field(default_factory=dict)
    key_parameter: str = DEFAULT_KEY
    shadow_version: int | None = None
    shadow_fraction: float = 0.0
    atol: float = DEFAULT_ATOL
    rtol: float = DEFAULT_RTOL


def kiln_parameters(parameters: Mapping[str, str]) -> dict[str, str]:
    """The routing-related subset of a model's config parameters."""
    return {k: v for k, v in parameters.items() if k.startswith(("kiln.ab.", "kiln.shadow."))}


def parse_routing_config(spec: ModelSpec) -> RoutingConfig:
    """Check a model's ``kiln.ab.*`` / ``kiln.shadow.*`` parameters; InvalidArgumentError names what is wrong."""
    name, given = spec.name, kiln_parameters(spec.parameters)
    unknown = sorted(set(given) - set(KNOWN_PARAMETERS))
    if unknown:
        raise InvalidArgumentError(f"model '{name}': unknown config parameter '{unknown[0]}'; the routing "
                                   f"parameters are {', '.join(KNOWN_PARAMETERS)}")
    if not given:
        return RoutingConfig()
    if spec.config.HasField("sequence_batching"):
        raise InvalidArgumentError(f"model '{name}': parameter '{sorted(given)[0]}' asks for A/B routing or shadow "
                                   f"traffic, which needs a stateless model; this one uses sequence_batching")
    weights = parse_weights(name, given[WEIGHTS]) if WEIGHTS in given else {}
    key = given.get(KEY, DEFAULT_KEY).strip()
    if not key:
        raise InvalidArgumentError(f"model '{name}': parameter '{KEY}' is empty; expected the name of the request "
                                   f"parameter that carries the sticky key, e.g. '{DEFAULT_KEY}'")
    shadow = parse_version(name, SHADOW_VERSION, given[SHADOW_VERSION]) if SHADOW_VERSION in given else None
    if (shadow is None) != (SHADOW_FRACTION not in given):
        present, missing = (SHADOW_VERSION, SHADOW_FRACTION) if shadow is not None else (SHADOW_FRACTION,
                                                                                           SHADOW_VERSION)
        raise InvalidArgumentError(f"model '{name}': parameter '{present}' is set without '{missing}'; shadow "
                                   f"traffic needs both (a version number and a fraction in [0, 1])")
    fraction = parse_fraction(name, SHADOW_FRACTION, given[SHADOW_FRACTION]) if shadow is not None else 0.0
    return RoutingConfig(weights, key, shadow, fraction,
                         _tolerance(name, SHADOW_ATOL, given.get(SHADOW_ATOL), DEFAULT_ATOL),
                         _tolerance(name, SHADOW_RTOL, given.get(SHADOW_RTOL), DEFAULT_RTOL))


def parse_weights(model: str, text: str) -> dict[int, float]:
    """``"1:90,2:10"`` -> ``{1: 90.0, 2: 10.0}``."""
    expected = "comma-separated version:weight pairs such as '1:90,2:10'"
    weights: dict[int, float] = {}
    for item in text.split(","):
        version, sep, weight = item.strip().partition(":")
        if not sep:
            raise InvalidArgumentError(f"model '{model}': parameter '{WEIGHTS}' is '{text}'; expected {expected}")
        number = parse_version(model, WEIGHTS, version.strip())
        if number in weights:
            raise InvalidArgumentError(f"model '{model}': parameter '{WEIGHTS}' is '{text}' and names version "
                                       f"{number} twice; expected {expected}")
        weights[number] = check_weight(model, WEIGHTS, number, weight.strip())
    return check_weights(model, WEIGHTS, weights)


def parse_version(model: str, key: str, value: object) -> int:
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        raise InvalidArgumentError(f"model '{model}': {key} has version '{value}'; expected a positive version "
                                   f"number")
    return int(text)


def check_weight(model: str, key: str, version: int, value: object) -> float:
    weight = _number(value)
    if weight is None or weight < 0:
        raise InvalidArgumentError(f"model '{model}': {key} gives version {version} the weight '{value}'; expected "
                                   f"a number >= 0")
    return weight


def check_weights(model: str, key: str, weights: dict[int, float]) -> dict[int, float]:
    if weights and not any(w > 0 for w in weights.values()):
        listed = ",".join(f"{v}:{w:g}" for v, w in sorted(weights.items()))
        raise InvalidArgumentError(f"model '{model}': {key} is '{listed}'; expected at least one weight above 0 "
                                   f"(leave the weights out to serve the newest version)")
    return weights


def parse_fraction(model: str, key: str, value: object) -> float:
    fraction = _number(value)
    if fraction is None or not 0.0 <= fraction <= 1.0:
        raise InvalidArgumentError(f"model '{model}': {key} is '{value}'; expected a fraction in [0, 1]")
    return fraction


def _tolerance(model: str, key: str, value: str | None, default: float) -> float:
    if value is None:
        return default
    tolerance = _number(value)
    if tolerance is None or tolerance < 0:
        raise InvalidArgumentError(f"model '{model}': parameter '{key}' is '{value}'; expected a number >= 0")
    return tolerance


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)  # type: ignore[arg-type]  # str, int or float; anything else fails below
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def rendezvous(key: str, weights: Mapping[int, float]) -> int:
    """The version that key ``key`` meets: weighted rendezvous hashing, so each version wins a share of keys
    proportional to its weight and a weight change moves only the keys it must."""
    best, best_score = 0, -math.inf
    for version, weight in sorted(weights.items()):
        digest = hashlib.blake2b(f"{key}\x00{version}".encode(), digest_size=8).digest()
        unit = (int.from_bytes(digest, "big") + 0.5) / 2.0**64  # uniform in (0, 1)
        score = -weight / math.log(unit)
        if score > best_score:
            best, best_score = version, score
    return best


@dataclass(frozen=True)
class VersionRouting:
    """One version as the routing status shows it. Latencies are of recent successful requests, in ms."""

    version: str
    ready: bool
    weight: float
    share: float  # of routed traffic it is meant to get now (weights renormalised over the ready versions)
    routed: int
    explicit: int
    latency_samples: int
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None


@dataclass(frozen=True)
class RoutingStatus:
    model: str
    source: str  # "config", "runtime" (set_routing replaced the config's) or "none" (newest version serves)
    key_parameter: str
    weights: dict[str, float]
    versions: list[VersionRouting]
    shadow: ShadowStats | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ModelRouting:
    """The routing of one model: weights in force, shadow traffic, and per-version counts and latencies."""

    def __init__(self, spec: ModelSpec, pool: _ShadowPool) -> None:
        self.spec = spec
        self.name = spec.name
        self.parameters = kiln_parameters(spec.parameters)
        config = parse_routing_config(spec)
        self.key_parameter = config.key_parameter
        self.source = "config" if config.weights or config.shadow_version is not None else "none"
        self._pool = pool
        self._weights = dict(config.weights)
        self._tolerances = config.atol, config.rtol
        self.shadow: Shadow | None = None
        if config.shadow_version is not None:
            self.shadow = Shadow(self.name, config.shadow_version, config.shadow_fraction, config.atol, config.rtol,
                                 pool.get)
        self._lock = threading.Lock()
        self._counts: dict[int, list[int]] = {}  # version -> [routed, explicit]
        self._latencies: dict[int, deque[int]] = {}
        self._random = random.Random()

    def choose(self, ready: Sequence[int], parameters: Mapping[str, object]) -> int | None:
        """The version a request without one goes to; None: no weights apply (the newest ready one serves)."""
        weights = self._weights
        live = {v: w for v, w in weights.items() if w > 0 and v in ready} if weights else None
        if not live:
            return None
        key = parameters.get(self.key_parameter)
        if key is not None:
            return rendezvous(str(key), live)
        pick = self._random.random() * sum(live.values())
        for version, weight in sorted(live.items()):
            pick -= weight
            if pick < 0:
                return version
        return max(live)  # only rounding reaches here

    @property
    def splits_traffic(self) -> bool:
        """True when requests without a version are spread by weights or mirrored to a shadow: each client's
        request must then be routed on its own."""
        return bool(self._weights) or self.shadow is not None

    def observe(self, version: int, routed: bool, latency_ns: int, known: Container[int], requests: int = 1) -> None:
        """A request this version answered successfully (``requests``: the clients' requests it stood for).
        ``known``: the versions the model still has; the first answer of a new version drops the counts of
        versions gone from it (and from the weights), so a model published every few seconds keeps counts for its
        current versions only."""
        with self._lock:
            counts = self._counts.get(version)
            if counts is None:
                for gone in [v for v in self._counts if v not in known and v not in self._weights]:
                    del self._counts[gone], self._latencies[gone]
                counts = self._counts[version] = [0, 0]
                self._latencies[version] = deque(maxlen=LATENCY_RESERVOIR)
            counts[0 if routed else 1] += requests
            self._latencies[version].append(latency_ns)

    def update(self, weights: Mapping[int, float] | None, shadow_version: int | None,
               shadow_fraction: float | None) -> None:
        """Replace the weights (``{}``: none) and/or the shadow settings (a fraction of 0 turns shadowing off).
        None leaves a setting as it is. Arguments are already checked (see Server.set_routing)."""
        with self._lock:
            if weights is not None:
                self._weights = dict(weights)
            if shadow_version is not None or shadow_fraction is not None:
                self.shadow = self._new_shadow(shadow_version, shadow_fraction)
            self.source = "runtime"

    def _new_shadow(self, version: int | None, fraction: float | None) -> Shadow | None:
        current = self.shadow
        if version is None and current is None:
            if fraction:
                raise InvalidArgumentError(f"model '{self.name}': a shadow fraction was given without a shadow "
                                           f"version; set shadow version and fraction together")
            return None
        if fraction == 0.0:
            return None
        if current is not None and version in (None, current.version):
            current.fraction = current.fraction if fraction is None else fraction
            return current
        if fraction is None:
            raise InvalidArgumentError(f"model '{self.name}': shadow version {version} was given without a "
                                       f"fraction; set shadow version and fraction together")
        assert version is not None
        return Shadow(self.name, version, fraction, *self._tolerances, self._pool.get)

    def status(self, ready: Sequence[int]) -> RoutingStatus:
        with self._lock:
            weights = dict(self._weights)
            counts = {v: list(c) for v, c in self._counts.items()}
            latencies = {v: np.fromiter(d, dtype=np.int64) for v, d in self._latencies.items()}
            shadow = self.shadow
        live_total = sum(w for v, w in weights.items() if v in ready)
        versions = []
        for version in sorted(set(ready) | set(weights) | set(counts)):
            weight = weights.get(version, 0.0)
            if weights and live_total > 0:
                share = weight / live_total if version in ready else 0.0
            else:
                share = 1.0 if ready and version == max(ready) else 0.0
            routed, explicit = counts.get(version, [0, 0])
            recent = latencies.get(version, np.empty(0, dtype=np.int64))
            p50, p90, p99 = (float(p) / 1e6 for p in np.percentile(recent, [50, 90, 99])) if recent.size else (
                None, None, None)
            versions.append(VersionRouting(str(version), version in ready, weight, share, routed, explicit,
                                           int(recent.size), p50, p90, p99))
        return RoutingStatus(self.name, self.source, self.key_parameter, {str(v): w for v, w in weights.items()},
                             versions, shadow.stats() if shadow is not None else None)


class _ShadowPool:
    """The few threads that run mirrored requests for callers without an event loop; started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kiln-shadow")
            return self._pool


class RoutingTable:
    """Every model's :class:`ModelRouting`, rebuilt when a reload changes its ``kiln.*`` parameters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, ModelRouting] = {}
        self._pool = _ShadowPool()

    def shadows(self) -> list[tuple[str, ShadowStats]]:
        """(model, stats) of every model with shadow traffic on, by model name."""
        with self._lock:
            routings = sorted(self._models.items())
        return [(name, r.shadow.stats()) for name, r in routings if r.shadow is not None]

    def model(self, spec: ModelSpec) -> ModelRouting:
        current = self._models.get(spec.name)
        if current is not None and current.spec is spec:
            return current
        with self._lock:
            current = self._models.get(spec.name)
            if current is not None and current.spec is not spec and current.parameters == kiln_parameters(
                    spec.parameters):
                current.spec = spec  # a reload with the same routing parameters keeps runtime settings
            elif current is None or current.spec is not spec:
                current = self._models[spec.name] = ModelRouting(spec, self._pool)
            return current
