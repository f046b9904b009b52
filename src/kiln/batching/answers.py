"""Handing a batch's answers from a worker thread to the callers that wait for them.

A caller on an event loop waits on an asyncio future of its loop; a blocking caller on a concurrent future. The
answers of one batch go to each loop in a single hand-off: waking the loop once per request (what
asyncio.wrap_future does) costs the worker a wake-up and the loop a callback for each, both under the GIL that the
next batch is waiting for, and lets the batch's callers resubmit one by one instead of together.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from concurrent.futures import Future, InvalidStateError

from kiln.v2.types import InferResponse

Answer = asyncio.Future[InferResponse] | Future[InferResponse]
Outcome = InferResponse | BaseException


def deliver(answers: Iterable[tuple[Answer, Outcome]]) -> None:
    """Settle each answer: event-loop futures in one call per loop, concurrent futures directly."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Answer, Outcome]]] = {}
    for answer, outcome in answers:
        if isinstance(answer, asyncio.Future):
            by_loop.setdefault(answer.get_loop(), []).append((answer, outcome))
        else:
            settle(answer, outcome)
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle_all, items)
        except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
            pass


def _settle_all(items: list[tuple[Answer, Outcome]]) -> None:
    for answer, outcome in items:
        settle(answer, outcome)


def settle(answer: Answer, outcome: Outcome) -> None:
    """Deliver one outcome, unless the caller gave up (a cancelled future must not take it, nor kill the worker).
    Call it on the answer's loop for an asyncio future."""
    if answer.done():
        return
    try:
        if isinstance(outcome, BaseException):
            answer.set_exception(outcome)
        else:
            answer.set_result(outcome)
    except (InvalidStateError, asyncio.InvalidStateError):
        pass
