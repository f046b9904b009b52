"""Answers reach their callers: event-loop callers in one hand-off per loop, blocking callers directly, and a
caller that gave up (or whose loop is gone) neither takes an answer nor breaks the delivery."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

from kiln.batching.answers import deliver
from kiln.v2.types import InferResponse


def response(tag: str) -> InferResponse:
    return InferResponse(model_name="m", model_version="1", outputs=[], id=tag)


async def test_one_hand_off_per_loop_and_blocking_callers_directly(hand_offs: list[object]) -> None:
    loop = asyncio.get_running_loop()
    waiting = [loop.create_future() for _ in range(3)]
    gave_up = loop.create_future()
    gave_up.cancel()
    blocking: Future[InferResponse] = Future()
    worker = threading.Thread(target=deliver, args=([
        (waiting[0], response("a")), (blocking, response("b")), (waiting[1], RuntimeError("failed")),
        (gave_up, response("c")), (waiting[2], response("d"))],))
    worker.start()
    worker.join()
    answers = await asyncio.gather(*waiting, return_exceptions=True)
    assert len(hand_offs) == 1
    assert [getattr(a, "id", str(a)) for a in answers] == ["a", "failed", "d"]
    assert blocking.result(0).id == "b" and gave_up.cancelled()


def test_a_closed_loop_is_skipped() -> None:
    loop = asyncio.new_event_loop()
    orphan = loop.create_future()
    loop.close()
    blocking: Future[InferResponse] = Future()
    deliver([(orphan, response("x")), (blocking, response("y"))])
    assert blocking.result(0).id == "y" and not orphan.done()
