"""What the user tells ``kiln advise``: latency budget, model count, update frequency, expected concurrency.

The parsers here serve the flags, the interactive prompt and the tests alike, so an answer typed at the prompt is
checked exactly like the same value given as a flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.errors import InvalidArgumentError

UPDATE_FREQUENCIES = ("never", "monthly", "weekly", "daily", "hourly")
NO_BUDGET = "none"


@dataclass(frozen=True)
class Inputs:
    """The facts about the deployment that the rules read. ``latency_budget_ms`` None means no budget."""

    latency_budget_ms: float | None = None
    models: int = 1
    update_frequency: str = "never"
    concurrency: int = 1

    def __post_init__(self) -> None:
        budget = self.latency_budget_ms
        if budget is not None and not (math.isfinite(budget) and budget > 0):
            raise InvalidArgumentError(f"latency budget: {budget} ms is not a positive number of milliseconds")
        if self.models < 1:
            raise InvalidArgumentError(f"models: {self.models} is not a model count; expected 1 or more")
        if self.update_frequency not in UPDATE_FREQUENCIES:
            raise InvalidArgumentError(f"update frequency: '{self.update_frequency}' is not one of "
                                       f"{', '.join(UPDATE_FREQUENCIES)}")
        if self.concurrency < 1:
            raise InvalidArgumentError(f"concurrency: {self.concurrency} is not a request count; expected 1 or more")


def parse_budget(text: str) -> float | None:
    """Milliseconds as a positive number, or ``none`` (or nothing) for no latency budget."""
    stripped = text.strip().lower().removesuffix("ms").strip()
    if stripped in ("", NO_BUDGET):
        return None
    try:
        value = float(stripped)
    except ValueError:
        raise InvalidArgumentError(f"latency budget: '{text}' is not a number of milliseconds or 'none'") from None
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgumentError(f"latency budget: '{text}' must be a positive number of milliseconds")
    return value


def parse_count(text: str, what: str) -> int:
    """A whole number of at least 1 (models, concurrent requests)."""
    try:
        value = int(text.strip())
    except ValueError:
        raise InvalidArgumentError(f"{what}: '{text}' is not a whole number") from None
    if value < 1:
        raise InvalidArgumentError(f"{what}: '{text}' must be 1 or more")
    return value


def parse_frequency(text: str) -> str:
    value = text.strip().lower()
    if value not in UPDATE_FREQUENCIES:
        raise InvalidArgumentError(f"update frequency: '{text}' is not one of {', '.join(UPDATE_FREQUENCIES)}")
    return value
