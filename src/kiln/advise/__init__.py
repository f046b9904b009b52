"""``kiln advise``: the direct-vs-server decision as a table of rules, with measured evidence.

    from kiln.advise import Inputs, advise, derive, load_compare

    inputs = Inputs(latency_budget_ms=10, models=3, update_frequency="weekly")
    evidence = derive(load_compare(Path("compare.json")), inputs)
    print(advise(inputs, evidence).render())
"""

from __future__ import annotations

from kiln.advise.advise import Layer, Recommendation, advise
from kiln.advise.compare_file import CompareResult, load_compare
from kiln.advise.evidence import Evidence, derive
from kiln.advise.inputs import UPDATE_FREQUENCIES, Inputs
from kiln.advise.rules import RULES, Facts, Rule, evaluate, facts_from, render_rules

__all__ = [
    "RULES", "UPDATE_FREQUENCIES", "CompareResult", "Evidence", "Facts", "Inputs", "Layer", "Recommendation", "Rule",
    "advise", "derive", "evaluate", "facts_from", "load_compare", "render_rules",
]
