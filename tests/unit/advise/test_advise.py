"""Recommendations: verdict, reasons, evidence and the layered plan, from inputs and a compare result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.advise import Inputs, advise, derive
from kiln.advise.compare_file import parse_compare


def recommend(compare: dict[str, Any] | None = None, **values: Any) -> Any:
    inputs = Inputs(**values)
    evidence = derive(parse_compare(compare, Path("compare.json")), inputs) if compare is not None else None
    return advise(inputs, evidence)


def test_direct_plan_keeps_everything_in_process() -> None:
    recommendation = recommend()
    assert recommendation.verdict == "direct"
    assert [(layer.role, layer.deployment) for layer in recommendation.plan] == [
        ("critical path", "direct"), ("monitoring", "application")]


def test_server_plan_names_the_models_and_the_update_path() -> None:
    recommendation = recommend(models=3, update_frequency="daily")
    assert recommendation.verdict == "server"
    front, monitoring = recommendation.plan
    assert (front.role, front.deployment, monitoring.deployment) == ("front-line services", "server", "server")
    assert "all 3 models" in front.detail and "without a restart" in front.detail


def test_hybrid_plan_is_the_layered_recommendation() -> None:
    recommendation = recommend(latency_budget_ms=10.0, models=3)
    assert recommendation.verdict == "hybrid"
    assert [(layer.role, layer.deployment) for layer in recommendation.plan] == [
        ("critical path", "direct"), ("front-line services", "server"), ("monitoring", "server")]
    assert "within 10 ms" in recommendation.plan[0].detail


def test_hybrid_for_updates_says_how_the_direct_path_gets_new_versions() -> None:
    critical = recommend(latency_budget_ms=10.0, update_frequency="hourly").plan[0]
    assert "loads each version the repository publishes" in critical.detail


def test_evidence_turns_a_tight_budget_hybrid_into_server(compare: dict[str, Any]) -> None:
    # Reference shape: at concurrency 8 the server with 3 models answers within 5.5 ms (p99).
    without = recommend(latency_budget_ms=10.0, models=3, concurrency=8)
    measured = recommend(compare, latency_budget_ms=10.0, models=3, concurrency=8)
    assert without.verdict == "hybrid"
    assert measured.verdict == "server"
    assert measured.overridden == ("latency-tight",)
    assert [f.rule for f in measured.findings] == ["latency-served-meets", "several-models", "memory-server-saves"]


def test_evidence_confirms_a_tight_budget_the_server_misses(compare: dict[str, Any]) -> None:
    # At concurrency 8 the server with 3 models misses a 5 ms budget (p99 5.5 ms) and direct meets it (4.0 ms).
    recommendation = recommend(compare, latency_budget_ms=5.0, models=3, concurrency=8)
    assert recommendation.verdict == "hybrid"
    assert [f.rule for f in recommendation.findings][:2] == ["latency-tight", "latency-only-direct-meets"]


def test_rendered_answer_has_verdict_reasons_evidence_and_plan(compare: dict[str, Any]) -> None:
    text = recommend(compare, latency_budget_ms=10.0, models=3, concurrency=8).render()
    assert text.startswith("recommendation: server: serve the models with kiln serve\n")
    assert "inputs: latency budget 10 ms, 3 models, updated never, expected concurrency 8" in text
    assert "  [several-models] server: 3 models" in text
    assert "  overridden by the evidence: latency-tight" in text
    assert "    c=8: direct 4.00 ms meets, served 4.60 ms meets, served with 3 models 5.50 ms meets" in text
    assert "  missing from the file: a served scenario measured with dynamic batching off and on" in text
    assert "plan:\n  front-line services  server" in text


def test_json_form_carries_the_numbers(compare: dict[str, Any]) -> None:
    data = recommend(compare, latency_budget_ms=10.0, models=3, concurrency=8).as_dict()
    assert data["verdict"] == "server"
    assert data["facts"]["served_p99_ms"] == 5.5 and data["facts"]["served_concurrency"] == 8
    assert data["evidence"]["per_extra_model_mb"] == 500.0
    assert round(data["evidence"]["throughput_ratio"]["served"]["8"], 3) == round(2600 / 2800, 3)
    assert data["inputs"] == {"latency_budget_ms": 10.0, "models": 3, "update_frequency": "never",
                              "concurrency": 8}
