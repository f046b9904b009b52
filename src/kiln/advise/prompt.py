"""Filling in the inputs the flags left out: ask at a terminal, otherwise take the defaults and say so."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from kiln._flags import checked, flag
from kiln.advise.inputs import UPDATE_FREQUENCIES, Inputs, parse_budget, parse_count, parse_frequency
from kiln.errors import InvalidArgumentError

ATTEMPTS = 3


@dataclass(frozen=True)
class Given:
    """The inputs as typed on the command line (None: flag not given); parsed like prompt answers. Their flags
    check the text with the same parsers and keep it."""

    latency_budget_ms: str | None = field(default=None, metadata=flag(
        "--latency-budget-ms", parse=checked(parse_budget), metavar="MS|none",
        help="the p99 latency the caller can afford, in ms ('none': no budget)"))
    models: str | None = field(default=None, metadata=flag(
        "--models", parse=checked(lambda text: parse_count(text, "models")), metavar="N",
        help="how many models the service hosts"))
    update_frequency: str | None = field(default=None, metadata=flag(
        "--update-frequency", parse=checked(parse_frequency), metavar="|".join(UPDATE_FREQUENCIES),
        help="how often a new model version ships"))
    concurrency: str | None = field(default=None, metadata=flag(
        "--concurrency", parse=checked(lambda text: parse_count(text, "concurrency")), metavar="N",
        help="requests in flight at once; picks the measured row the evidence rules read (default 1)"))


@dataclass(frozen=True)
class Question:
    field: str
    flag: str
    text: str
    default: str
    assumed: str  # what the answer says when the default is taken without asking
    parse: Callable[[str], object]


QUESTIONS = (
    Question("latency_budget_ms", "--latency-budget-ms", "p99 latency budget in ms ('none' for no budget)", "none",
             "no latency budget", parse_budget),
    Question("models", "--models", "how many models will the service host", "1", "1 model",
             lambda text: parse_count(text, "models")),
    Question("update_frequency", "--update-frequency",
             f"how often is the model updated ({', '.join(UPDATE_FREQUENCIES)})", "never", "never updated",
             parse_frequency),
    Question("concurrency", "--concurrency", "how many requests at once do you expect", "1",
             "expected concurrency 1", lambda text: parse_count(text, "concurrency")),
)


def resolve(given: Given, *, interactive: bool, ask_concurrency: bool, stdin: TextIO,
            stdout: TextIO) -> tuple[Inputs, tuple[str, ...]]:
    """The complete inputs and, for each default taken without asking, a line that says so.

    The concurrency only selects which measured row the evidence rules read, so it is asked for (or reported as
    assumed) only when ``ask_concurrency`` says evidence was given.
    """
    values: dict[str, Any] = {}  # each parser returns its field's type; Inputs checks the values again
    assumed: list[str] = []
    for question in QUESTIONS:
        text = getattr(given, question.field)
        if text is not None:
            values[question.field] = question.parse(text)
        elif question.field == "concurrency" and not ask_concurrency:
            values[question.field] = question.parse(question.default)
        elif interactive:
            values[question.field] = ask(question, stdin, stdout)
        else:
            values[question.field] = question.parse(question.default)
            assumed.append(f"{question.assumed} ({question.flag} not given)")
    return Inputs(**values), tuple(assumed)


def ask(question: Question, stdin: TextIO, stdout: TextIO) -> object:
    """Ask until the answer parses (an empty answer takes the default); give up after a few bad answers."""
    for _ in range(ATTEMPTS):
        stdout.write(f"{question.text} [{question.default}]: ")
        stdout.flush()
        line = stdin.readline()
        if not line:
            raise InvalidArgumentError(f"{question.flag}: the input ended before '{question.text}' was answered; "
                                       f"pass {question.flag} instead")
        try:
            return question.parse(line.strip() or question.default)
        except InvalidArgumentError as exc:
            stdout.write(f"  {exc}\n")
    raise InvalidArgumentError(f"{question.flag}: no valid answer after {ATTEMPTS} tries")
