"""Missing inputs: asked at a terminal (fake stdin here), defaulted and reported otherwise."""

from __future__ import annotations

import io
from typing import Any

import pytest

from kiln.advise.inputs import Inputs
from kiln.advise.prompt import Given, resolve
from kiln.errors import InvalidArgumentError


def ask(answers: str, given: Given | None = None, evidence: bool = False) -> tuple[Inputs, tuple[str, ...], str]:
    out = io.StringIO()
    inputs, assumed = resolve(given or Given(), interactive=True, ask_concurrency=evidence,
                              stdin=io.StringIO(answers), stdout=out)
    return inputs, assumed, out.getvalue()


def test_answers_fill_every_missing_input() -> None:
    inputs, assumed, asked = ask("12.5\n3\nDaily\n8\n", evidence=True)
    assert inputs == Inputs(latency_budget_ms=12.5, models=3, update_frequency="daily", concurrency=8)
    assert assumed == ()
    assert asked.count("]: ") == 4 and "p99 latency budget in ms" in asked


def test_empty_answers_take_the_defaults_shown() -> None:
    inputs, assumed, asked = ask("\n\n\n")
    assert inputs == Inputs()
    assert assumed == ()
    assert "[none]: " in asked and "[1]: " in asked and "[never]: " in asked


def test_concurrency_is_asked_only_with_evidence() -> None:
    _, _, asked = ask("none\n1\nnever\n")
    assert "requests at once" not in asked


def test_flags_given_are_not_asked() -> None:
    inputs, _, asked = ask("weekly\n", Given(latency_budget_ms="8", models="2"))
    assert inputs == Inputs(latency_budget_ms=8.0, models=2, update_frequency="weekly")
    assert asked.count("]: ") == 1


def test_a_bad_answer_is_explained_and_asked_again() -> None:
    inputs, _, asked = ask("soon\n-3\n5ms\n0\n2\nfortnightly\nmonthly\n")
    assert inputs == Inputs(latency_budget_ms=5.0, models=2, update_frequency="monthly")
    assert "latency budget: 'soon' is not a number of milliseconds or 'none'" in asked
    assert "models: '0' must be 1 or more" in asked
    assert "update frequency: 'fortnightly' is not one of never, monthly, weekly, daily, hourly" in asked


def test_three_bad_answers_give_up() -> None:
    with pytest.raises(InvalidArgumentError, match="--models: no valid answer after 3 tries"):
        ask("\nx\ny\nz\n")


def test_input_that_ends_early_is_an_error_naming_the_flag() -> None:
    with pytest.raises(InvalidArgumentError, match="--update-frequency: the input ended.*pass --update-frequency"):
        ask("10\n2\n")


def test_without_a_terminal_defaults_are_taken_and_reported() -> None:
    out = io.StringIO()
    inputs, assumed = resolve(Given(models="4"), interactive=False, ask_concurrency=True, stdin=io.StringIO(),
                              stdout=out)
    assert inputs == Inputs(models=4)
    assert assumed == ("no latency budget (--latency-budget-ms not given)",
                       "never updated (--update-frequency not given)",
                       "expected concurrency 1 (--concurrency not given)")
    assert out.getvalue() == ""


def test_explicit_none_budget_is_not_an_assumption() -> None:
    _, assumed = resolve(Given(latency_budget_ms="none", models="1", update_frequency="never"), interactive=False,
                         ask_concurrency=False, stdin=io.StringIO(), stdout=io.StringIO())
    assert assumed == ()


@pytest.mark.parametrize(("values", "message"), [
    ({"latency_budget_ms": 0.0}, "latency budget: 0.0 ms is not a positive"),
    ({"latency_budget_ms": float("nan")}, "latency budget: nan ms"),
    ({"models": 0}, "models: 0 is not a model count"),
    ({"update_frequency": "yearly"}, "update frequency: 'yearly' is not one of"),
    ({"concurrency": 0}, "concurrency: 0 is not a request count"),
])
def test_inputs_are_checked(values: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        Inputs(**values)
