"""Inputs and evidence -> a :class:`Recommendation`: the verdict, the reasons, the evidence and a layered plan.

The plan follows the layered pattern: the server for front-line services, the direct engine for the
latency-critical path, monitoring through the server. A verdict keeps only the layers it uses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kiln.advise.evidence import Evidence
from kiln.advise.inputs import Inputs
from kiln.advise.rules import Facts, Finding, Verdict, evaluate, facts_from

SUMMARY: dict[Verdict, str] = {
    "direct": "run the engine in-process with kiln.load",
    "server": "serve the models with kiln serve",
    "hybrid": "the direct engine on the latency-critical path, kiln serve for the rest",
}


@dataclass(frozen=True)
class Layer:
    role: str
    deployment: str
    detail: str


@dataclass(frozen=True)
class Recommendation:
    verdict: Verdict
    inputs: Inputs
    assumed: tuple[str, ...]
    facts: Facts
    findings: tuple[Finding, ...]
    overridden: tuple[str, ...]
    plan: tuple[Layer, ...]
    evidence: Evidence | None = None

    @property
    def missing(self) -> tuple[str, ...]:
        return self.evidence.missing if self.evidence else ()

    def as_dict(self) -> dict[str, Any]:
        evidence = None
        if self.evidence is not None:
            evidence = {
                "file": str(self.evidence.source.path), "model": self.evidence.source.model,
                "lines": list(self.evidence.lines), "missing": list(self.evidence.missing),
                "per_extra_model_mb": self.evidence.per_extra_model_mb,
                "throughput_ratio": {label: {str(c): r for c, r in by_c.items()}
                                     for label, by_c in self.evidence.throughput_ratio.items()},
                "batching_gain": {str(c): gain for c, gain in self.evidence.batching_gain.items()},
            }
        return {
            "verdict": self.verdict, "summary": SUMMARY[self.verdict],
            "inputs": dataclasses.asdict(self.inputs), "assumed": list(self.assumed),
            "facts": dataclasses.asdict(self.facts),
            "reasons": [{"rule": f.rule, "verdict": f.verdict, "text": f.text} for f in self.findings],
            "overridden": list(self.overridden), "evidence": evidence,
            "plan": [dataclasses.asdict(layer) for layer in self.plan],
        }

    def render(self) -> str:
        lines = [f"recommendation: {self.verdict}: {SUMMARY[self.verdict]}", f"inputs: {_describe(self.inputs)}"]
        lines += [f"  assumed: {item}" for item in self.assumed]
        lines.append("reasons:")
        lines += [f"  [{f.rule}] {f.verdict}: {f.text}" for f in self.findings]
        if self.overridden:
            lines.append(f"  overridden by the evidence: {', '.join(self.overridden)}")
        if self.evidence is not None:
            lines.append("evidence:")
            lines += [f"  {line}" for line in self.evidence.lines]
            if self.evidence.missing:
                lines.append(f"  missing from the file: {', '.join(self.evidence.missing)}")
        lines.append("plan:")
        width = max(len(layer.role) for layer in self.plan)
        lines += [f"  {layer.role:<{width}}  {layer.deployment:<11}  {layer.detail}" for layer in self.plan]
        return "\n".join(lines)


def advise(inputs: Inputs, evidence: Evidence | None = None, assumed: tuple[str, ...] = ()) -> Recommendation:
    facts = facts_from(inputs, evidence)
    outcome = evaluate(facts)
    rules = {finding.rule for finding in outcome.findings}
    return Recommendation(verdict=outcome.verdict, inputs=inputs, assumed=assumed, facts=facts,
                          findings=outcome.findings, overridden=outcome.overridden,
                          plan=_plan(outcome.verdict, rules, inputs), evidence=evidence)


def _describe(inputs: Inputs) -> str:
    budget = "no latency budget" if inputs.latency_budget_ms is None else \
        f"latency budget {inputs.latency_budget_ms:g} ms"
    models = "1 model" if inputs.models == 1 else f"{inputs.models} models"
    return (f"{budget}, {models}, updated {inputs.update_frequency}, "
            f"expected concurrency {inputs.concurrency}")


def _plan(verdict: Verdict, rules: set[str], inputs: Inputs) -> tuple[Layer, ...]:
    monitoring = "Prometheus metrics (nv_inference_*) and the statistics extension of kiln serve"
    if verdict == "direct":
        return (Layer("critical path", "direct", "every model in the application process: kiln.load(path).infer("
                      "inputs), after kiln build for the fastest engine"),
                Layer("monitoring", "application", "the direct engine has no metrics endpoint: record latency and "
                      "errors in the application, or mirror a sample of requests to a kiln server to watch them"))
    front = _front_line(rules, inputs)
    if verdict == "server":
        return Layer("front-line services", "server", front), Layer("monitoring", "server", monitoring)
    budget = f"{inputs.latency_budget_ms:g} ms" if inputs.latency_budget_ms is not None else "its latency budget"
    critical = f"the model that must answer within {budget}, in-process via kiln.load"
    if "frequent-updates" in rules:
        critical += "; it loads each version the repository publishes, at its own pace"
    return (Layer("critical path", "direct", critical),
            Layer("front-line services", "server", front),
            Layer("monitoring", "server", f"{monitoring}; the direct path reports latency and errors from the "
                  "application"))


def _front_line(rules: set[str], inputs: Inputs) -> str:
    parts = ["kiln serve over a model repository; clients call HTTP or gRPC (tritonclient works unchanged)"]
    if "several-models" in rules:
        count = "both" if inputs.models == 2 else f"all {inputs.models}"
        parts.append(f"{count} models side by side in one repository")
    if "frequent-updates" in rules:
        parts.append("publish each new version into the repository (--model-control-mode poll or explicit) and the "
                     "server swaps it in without a restart")
    return "; ".join(parts)
