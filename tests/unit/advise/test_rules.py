"""The advise rule table, row by row: inputs (and measured p99 / memory) -> verdict, reasons, overridden rows."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kiln.advise.rules import RULES, Facts, evaluate, render_rules, rules_as_json

DOCS = Path(__file__).resolve().parents[3] / "docs" / "advise.md"


def facts(**values: Any) -> Facts:
    base: dict[str, Any] = {"latency_budget_ms": None, "models": 1, "update_frequency": "never", "concurrency": 1}
    base.update(values)
    return Facts(**base)


# (id, facts, verdict, reason ids in order, overridden)
TABLE: list[tuple[str, dict[str, Any], str, list[str], list[str]]] = [
    # The reference decision tree, one branch at a time.
    ("nothing-given", {}, "direct", ["otherwise-direct"], []),
    ("budget-10", {"latency_budget_ms": 10.0}, "direct", ["latency-tight"], []),
    ("budget-just-under-20", {"latency_budget_ms": 19.99}, "direct", ["latency-tight"], []),
    ("budget-20-is-not-under-20", {"latency_budget_ms": 20.0}, "direct", ["otherwise-direct"], []),
    ("budget-100", {"latency_budget_ms": 100.0}, "direct", ["otherwise-direct"], []),
    ("two-models", {"models": 2}, "server", ["several-models"], []),
    ("ten-models", {"models": 10}, "server", ["several-models"], []),
    ("monthly", {"update_frequency": "monthly"}, "direct", ["otherwise-direct"], []),
    ("weekly", {"update_frequency": "weekly"}, "server", ["frequent-updates"], []),
    ("daily", {"update_frequency": "daily"}, "server", ["frequent-updates"], []),
    ("hourly", {"update_frequency": "hourly"}, "server", ["frequent-updates"], []),
    ("models-and-updates", {"models": 3, "update_frequency": "hourly"}, "server",
     ["several-models", "frequent-updates"], []),
    ("loose-budget-models-updates", {"latency_budget_ms": 50.0, "models": 3, "update_frequency": "daily"}, "server",
     ["several-models", "frequent-updates"], []),
    # Conflicts: a tight budget with a server reason -> hybrid.
    ("tight-and-models", {"latency_budget_ms": 10.0, "models": 3}, "hybrid", ["latency-tight", "several-models"], []),
    ("tight-and-updates", {"latency_budget_ms": 5.0, "update_frequency": "daily"}, "hybrid",
     ["latency-tight", "frequent-updates"], []),
    ("tight-models-updates", {"latency_budget_ms": 5.0, "models": 2, "update_frequency": "weekly"}, "hybrid",
     ["latency-tight", "several-models", "frequent-updates"], []),
    # Evidence: the served p99 meets a tight budget -> the budget no longer forces direct.
    ("served-meets-tight", {"latency_budget_ms": 10.0, "served_p99_ms": 8.0, "served_concurrency": 1,
                            "direct_p99_ms": 6.0, "direct_concurrency": 1},
     "direct", ["latency-served-meets", "otherwise-direct"], ["latency-tight"]),
    ("served-meets-exactly", {"latency_budget_ms": 10.0, "served_p99_ms": 10.0, "served_concurrency": 1},
     "direct", ["latency-served-meets", "otherwise-direct"], ["latency-tight"]),
    ("served-meets-tight-models", {"latency_budget_ms": 10.0, "models": 3, "served_p99_ms": 8.0,
                                   "served_concurrency": 8, "direct_p99_ms": 6.0, "direct_concurrency": 8},
     "server", ["latency-served-meets", "several-models"], ["latency-tight"]),
    ("served-misses-tight", {"latency_budget_ms": 10.0, "served_p99_ms": 12.0, "served_concurrency": 1,
                             "direct_p99_ms": 6.0, "direct_concurrency": 1},
     "direct", ["latency-tight", "latency-only-direct-meets"], []),
    ("served-misses-tight-updates", {"latency_budget_ms": 10.0, "update_frequency": "hourly", "served_p99_ms": 12.0,
                                     "served_concurrency": 1, "direct_p99_ms": 6.0, "direct_concurrency": 1},
     "hybrid", ["latency-tight", "latency-only-direct-meets", "frequent-updates"], []),
    # Evidence can make a loose budget decisive.
    ("served-misses-loose", {"latency_budget_ms": 50.0, "served_p99_ms": 60.0, "served_concurrency": 16,
                             "direct_p99_ms": 30.0, "direct_concurrency": 16},
     "direct", ["latency-only-direct-meets"], []),
    ("served-misses-loose-models", {"latency_budget_ms": 50.0, "models": 3, "served_p99_ms": 60.0,
                                    "served_concurrency": 16, "direct_p99_ms": 30.0, "direct_concurrency": 16},
     "hybrid", ["latency-only-direct-meets", "several-models"], []),
    ("only-served-meets-loose", {"latency_budget_ms": 50.0, "served_p99_ms": 40.0, "served_concurrency": 64,
                                 "direct_p99_ms": 60.0, "direct_concurrency": 64},
     "server", ["latency-only-served-meets"], []),
    ("only-served-meets-tight", {"latency_budget_ms": 10.0, "served_p99_ms": 8.0, "served_concurrency": 64,
                                 "direct_p99_ms": 12.0, "direct_concurrency": 64},
     "server", ["latency-served-meets", "latency-only-served-meets"], ["latency-tight"]),
    ("none-meets-tight", {"latency_budget_ms": 10.0, "served_p99_ms": 15.0, "served_concurrency": 1,
                          "direct_p99_ms": 12.0, "direct_concurrency": 1},
     "direct", ["latency-tight", "latency-none-meets"], []),
    ("none-meets-loose", {"latency_budget_ms": 50.0, "served_p99_ms": 70.0, "served_concurrency": 1,
                          "direct_p99_ms": 60.0, "direct_concurrency": 1},
     "direct", ["latency-none-meets", "otherwise-direct"], []),
    # Half the evidence: only the rows whose measurements exist can hold.
    ("only-direct-measured", {"latency_budget_ms": 10.0, "direct_p99_ms": 5.0, "direct_concurrency": 1},
     "direct", ["latency-tight"], []),
    ("no-budget-with-evidence", {"served_p99_ms": 5.0, "served_concurrency": 1, "direct_p99_ms": 4.0,
                                 "direct_concurrency": 1}, "direct", ["otherwise-direct"], []),
    # Memory notes: evidence only, no vote.
    ("memory-saves", {"models": 3, "direct_memory_mb": 8400.0, "server_memory_mb": 4100.0}, "server",
     ["several-models", "memory-server-saves"], []),
    ("memory-costs", {"models": 3, "direct_memory_mb": 3000.0, "server_memory_mb": 3000.0}, "server",
     ["several-models", "memory-server-costs"], []),
]


@pytest.mark.parametrize(("values", "verdict", "reasons", "overridden"), [row[1:] for row in TABLE],
                         ids=[row[0] for row in TABLE])
def test_rule_table(values: dict[str, Any], verdict: str, reasons: list[str], overridden: list[str]) -> None:
    outcome = evaluate(facts(**values))
    assert outcome.verdict == verdict
    assert [finding.rule for finding in outcome.findings] == reasons
    assert list(outcome.overridden) == overridden


def test_every_rule_is_exercised_by_the_table() -> None:
    held = {finding.rule for _, values, *_ in TABLE for finding in evaluate(facts(**values)).findings}
    overridden = {rule for _, values, *_ in TABLE for rule in evaluate(facts(**values)).overridden}
    assert held | overridden == {rule.id for rule in RULES}


def test_reasons_carry_the_numbers_they_rest_on() -> None:
    outcome = evaluate(facts(latency_budget_ms=10.0, models=3, served_p99_ms=8.25, served_concurrency=8,
                             served_label="served with 3 models", direct_memory_mb=8400.0, server_memory_mb=4100.0))
    texts = {finding.rule: finding.text for finding in outcome.findings}
    assert "8.25 ms served with 3 models" in texts["latency-served-meets"]
    assert "concurrency 8" in texts["latency-served-meets"] and "10 ms budget" in texts["latency-served-meets"]
    assert texts["several-models"].startswith("3 models")
    assert "4,100 MB" in texts["memory-server-saves"] and "8,400 MB" in texts["memory-server-saves"]


def test_rule_ids_are_unique_and_the_fallback_comes_last() -> None:
    ids = [rule.id for rule in RULES]
    assert len(ids) == len(set(ids))
    assert [rule.fallback for rule in RULES] == [False] * (len(RULES) - 1) + [True]
    assert all(target in ids for rule in RULES for target in rule.overrides)


def test_printed_table_lists_every_rule_and_the_combination() -> None:
    table = render_rules()
    for rule in RULES:
        assert re.search(rf"^{re.escape(rule.id)}\s+{rule.verdict}\s+{re.escape(rule.when)}", table, re.MULTILINE)
    assert "direct and server votes -> hybrid" in table
    assert [row["id"] for row in rules_as_json()] == [rule.id for rule in RULES]


def test_docs_table_matches_the_rules() -> None:
    text = DOCS.read_text()
    for rule in RULES:
        assert f"| `{rule.id}` | {rule.when} | {rule.verdict} |" in text, rule.id
