"""The direct-vs-server decision as a table of rules.

The reference decision tree (a latency budget under 20 ms -> direct; several models -> server; frequent model
updates -> server; otherwise direct) is rows ``latency-tight``, ``several-models``, ``frequent-updates`` and
``otherwise-direct``. The other rows read measured evidence (a ``kiln bench compare`` result) and either vote, add
a note, or override a row whose premise the measurement contradicts.

Every row that holds is kept, in table order, except rows overridden by another row that holds. The verdict comes
from the votes left: direct and server votes together -> ``hybrid`` (the direct engine on the latency-critical path,
the server for the rest), only direct -> ``direct``, only server -> ``server``; ``otherwise-direct`` holds when no
row above it voted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kiln.advise.evidence import Evidence
from kiln.advise.inputs import Inputs

Vote = Literal["direct", "server", "note"]
Verdict = Literal["direct", "server", "hybrid"]

TIGHT_BUDGET_MS = 20.0  # "a latency budget under 20 ms": strictly under
SEVERAL_MODELS = 2  # one model is not "several"; two already share a device and a deployment
FREQUENT_UPDATES = ("weekly", "daily", "hourly")  # faster than a typical application release cycle


@dataclass(frozen=True)
class Facts:
    """What the conditions read: the inputs, plus the evidence at the expected concurrency when a file was given."""

    latency_budget_ms: float | None
    models: int
    update_frequency: str
    concurrency: int
    direct_p99_ms: float | None = None
    direct_concurrency: int | None = None
    served_p99_ms: float | None = None
    served_concurrency: int | None = None
    served_label: str = "served"
    direct_memory_mb: float | None = None  # one direct process per model
    server_memory_mb: float | None = None  # one server hosting every model


def facts_from(inputs: Inputs, evidence: Evidence | None = None) -> Facts:
    facts = Facts(latency_budget_ms=inputs.latency_budget_ms, models=inputs.models,
                  update_frequency=inputs.update_frequency, concurrency=inputs.concurrency)
    if evidence is None:
        return facts
    direct, served = evidence.direct, evidence.served
    totals = evidence.memory_totals_mb(inputs.models)
    return dataclasses.replace(
        facts,
        direct_p99_ms=direct.p99_ms if direct else None, direct_concurrency=direct.concurrency if direct else None,
        served_p99_ms=served.p99_ms if served else None, served_concurrency=served.concurrency if served else None,
        served_label=served.label if served else "served",
        direct_memory_mb=totals[0] if totals else None, server_memory_mb=totals[1] if totals else None)


@dataclass(frozen=True)
class Rule:
    id: str
    when: str
    verdict: Vote
    reason: str  # str.format template over the Facts fields
    condition: Callable[[Facts], bool]
    overrides: tuple[str, ...] = ()
    fallback: bool = False  # holds only when no earlier row voted


def _tight(f: Facts) -> bool:
    return f.latency_budget_ms is not None and f.latency_budget_ms < TIGHT_BUDGET_MS


def _meets(p99_ms: float | None, f: Facts) -> bool | None:
    """Whether a measured p99 fits the budget; None when either is unknown."""
    if p99_ms is None or f.latency_budget_ms is None:
        return None
    return p99_ms <= f.latency_budget_ms


def _memory_known(f: Facts) -> bool:
    return f.models >= SEVERAL_MODELS and f.direct_memory_mb is not None and f.server_memory_mb is not None


RULES: tuple[Rule, ...] = (
    Rule("latency-tight", "latency budget under 20 ms", "direct",
         "the latency budget of {latency_budget_ms:g} ms is under 20 ms: call the engine in-process, with no "
         "network hop, codec or queue on the request path", _tight),
    Rule("latency-served-meets", "evidence: budget under 20 ms and the served p99 within it", "note",
         "measured at concurrency {served_concurrency}: p99 {served_p99_ms:.2f} ms {served_label}, within the "
         "{latency_budget_ms:g} ms budget, so the budget alone does not call for the direct engine",
         lambda f: _tight(f) and _meets(f.served_p99_ms, f) is True, overrides=("latency-tight",)),
    Rule("latency-only-direct-meets", "evidence: direct p99 within the budget, served p99 over it", "direct",
         "measured: p99 {served_p99_ms:.2f} ms {served_label} at concurrency {served_concurrency} misses the "
         "{latency_budget_ms:g} ms budget; p99 {direct_p99_ms:.2f} ms direct at concurrency {direct_concurrency} "
         "meets it",
         lambda f: _meets(f.direct_p99_ms, f) is True and _meets(f.served_p99_ms, f) is False),
    Rule("latency-only-served-meets", "evidence: served p99 within the budget, direct p99 over it", "server",
         "measured: p99 {served_p99_ms:.2f} ms {served_label} at concurrency {served_concurrency} meets the "
         "{latency_budget_ms:g} ms budget; p99 {direct_p99_ms:.2f} ms direct at concurrency {direct_concurrency} "
         "does not",
         lambda f: _meets(f.served_p99_ms, f) is True and _meets(f.direct_p99_ms, f) is False),
    Rule("latency-none-meets", "evidence: both p99s over the budget", "note",
         "measured: neither path meets the {latency_budget_ms:g} ms budget (p99 {direct_p99_ms:.2f} ms direct at "
         "concurrency {direct_concurrency}, {served_p99_ms:.2f} ms {served_label} at concurrency {served_concurrency}"
         "): a faster engine (kiln build: FP16, INT8) or more hardware is needed whichever way it is deployed",
         lambda f: _meets(f.direct_p99_ms, f) is False and _meets(f.served_p99_ms, f) is False),
    Rule("several-models", "2 or more models", "server",
         "{models} models: one server hosts them side by side, shares the device between them and gives each its own "
         "queue and instances", lambda f: f.models >= SEVERAL_MODELS),
    Rule("frequent-updates", "model updated weekly, daily or hourly", "server",
         "the model is updated {update_frequency}: the server swaps versions without a restart or an application "
         "release", lambda f: f.update_frequency in FREQUENT_UPDATES),
    Rule("memory-server-saves", "evidence: 2+ models and one server uses less memory than a direct process each",
         "note", "measured memory, extrapolated to {models} models: one server {server_memory_mb:,.0f} MB vs "
         "{direct_memory_mb:,.0f} MB for a direct process per model",
         lambda f: _memory_known(f) and (f.server_memory_mb or 0.0) < (f.direct_memory_mb or 0.0)),
    Rule("memory-server-costs", "evidence: 2+ models and one server uses as much memory as a direct process each",
         "note", "measured memory, extrapolated to {models} models: one server {server_memory_mb:,.0f} MB vs "
         "{direct_memory_mb:,.0f} MB for a direct process per model, so the server saves no memory here",
         lambda f: _memory_known(f) and (f.server_memory_mb or 0.0) >= (f.direct_memory_mb or 0.0)),
    Rule("otherwise-direct", "no row above votes", "direct",
         "nothing calls for the server: the direct engine is the simplest and fastest deployment",
         lambda f: True, fallback=True),
)

COMBINATION: tuple[tuple[str, Verdict], ...] = (
    ("direct and server votes", "hybrid"),
    ("direct votes only", "direct"),
    ("server votes only", "server"),
)


@dataclass(frozen=True)
class Finding:
    rule: str
    verdict: Vote
    text: str


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    findings: tuple[Finding, ...]
    overridden: tuple[str, ...]


def evaluate(facts: Facts, rules: tuple[Rule, ...] = RULES) -> Outcome:
    held = {rule.id for rule in rules if not rule.fallback and rule.condition(facts)}
    overridden = {target for rule in rules if rule.id in held for target in rule.overrides} & held
    kept = [rule for rule in rules if rule.id in held - overridden]
    votes = {rule.verdict for rule in kept} - {"note"}
    if not votes:
        kept += [rule for rule in rules if rule.fallback and rule.condition(facts)]
        votes = {rule.verdict for rule in kept} - {"note"}
    verdict: Verdict = "hybrid" if votes == {"direct", "server"} else "server" if votes == {"server"} else "direct"
    values = dataclasses.asdict(facts)
    findings = tuple(Finding(rule.id, rule.verdict, rule.reason.format(**values)) for rule in kept)
    return Outcome(verdict=verdict, findings=findings,
                   overridden=tuple(rule.id for rule in rules if rule.id in overridden))


def render_rules(rules: tuple[Rule, ...] = RULES) -> str:
    """The table as ``kiln advise --rules`` prints it."""
    width = max(len(rule.id) for rule in rules)
    lines = [f"{'rule':<{width}}  {'verdict':<7}  when", f"{'-' * width}  {'-' * 7}  {'-' * 4}"]
    for rule in rules:
        extra = f" (overrides {', '.join(rule.overrides)})" if rule.overrides else ""
        lines.append(f"{rule.id:<{width}}  {rule.verdict:<7}  {rule.when}{extra}")
    lines += ["", "Every row that holds counts, in order; an overridden row does not. Verdict from the votes left:"]
    lines += [f"  {votes} -> {verdict}" for votes, verdict in COMBINATION]
    return "\n".join(lines)


def rules_as_json(rules: tuple[Rule, ...] = RULES) -> list[dict[str, object]]:
    return [{"id": rule.id, "when": rule.when, "verdict": rule.verdict, "overrides": list(rule.overrides),
             "fallback": rule.fallback} for rule in rules]
