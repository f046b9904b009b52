"""A worker's infer requests to the server process and their answers, whichever frontend the worker serves.

A request that finds the worker idle (no infer call of its own outstanding) leaves at once: nothing could join it.
Otherwise it waits for the end of the event-loop turn, and the requests of that turn that share a join key
(kiln.v2.joined) leave together as one joined request: the server process then does its per-request work (reading
the descriptor, admission, validation, the batcher's queue, the answer's descriptor and frame) once for all of them,
which is what bounds a server fed by several worker processes (docs/serving.md, "HTTP workers"). Clients whose
answers came back together send their next requests in the same turn, so under load requests keep leaving in
groups, while a lone client's request waits for nothing.

Every request has a call id of its own; a joined request's members have consecutive ones, and the server process
answers a run of them with one answer on the first one's id (``joined_kind``, its outputs holding their rows in
order) or each member on its own id (where the model does not batch, or a member's request was refused).
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

from kiln.errors import InternalError
from kiln.frontends.handoff.arena import Arena
from kiln.frontends.handoff.frames import FrameProtocol, Releases
from kiln.frontends.handoff.tensors import (
    decode_answer,
    decode_response,
    encode_joined,
    encode_request,
    response_slot,
)
from kiln.v2.joined import MAX_MEMBERS, join_key, rows_of, split_response
from kiln.v2.types import InferRequest, InferResponse

LOST = 0  # not a frame kind: the link to the server process closed
JOIN_VARIABLE = "KILN_JOIN_REQUESTS"
"""Set to 0 (or false, no, off) in `kiln serve`'s environment, which its workers inherit, to send every infer
request on its own (to compare, or to rule joining out)."""

Answer = tuple[InferResponse, Callable[[], None]]
"""An answer (its outputs views on the response arena) and what to call once they are encoded: it lets the
arena slot go."""
Framer = Callable[[int, bytes], bytes]  # (call id, descriptor) -> frame


def joining_enabled() -> bool:
    """What this worker's environment says about joining (on unless ``KILN_JOIN_REQUESTS`` turns it off)."""
    return os.environ.get(JOIN_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


class Refused(Exception):
    """The server process answered with an error frame (its kind and payload, as the link words them), or the link
    is gone (kind ``LOST``)."""

    def __init__(self, kind: int, payload: bytes = b"") -> None:
        super().__init__(kind)
        self.kind = kind
        self.payload = payload


@dataclass
class _Sent:
    future: asyncio.Future[Answer]
    rows: int
    request_id: str


class _SharedSlot:
    """An arena slot that several members' answers view: it goes back once each has been encoded."""

    def __init__(self, slot: int, holders: int, give_back: Callable[[int], None]) -> None:
        self._slot = slot
        self._holders = holders
        self._give_back = give_back

    def release(self) -> None:
        self._holders -= 1
        if self._holders == 0:
            self._give_back(self._slot)


def _nothing() -> None:
    pass


class InferCalls:
    """One worker's infer calls over its link. ``infer_frame``/``joined_frame`` frame a request's and a joined
    request's descriptor in the link's words; ``answer_kind``/``joined_kind`` are the frame kinds of an answer to
    one request and to a run of joined members (any other kind on an infer call's id is its error). ``join``
    False sends every request on its own (benchmarks/handoff_ceiling.py measures both)."""

    def __init__(self, protocol: FrameProtocol, releases: Releases, ids: Iterator[int], request_arena: Arena | None,
                 response_arena: Arena | None, *, infer_frame: Framer, joined_frame: Framer, answer_kind: int,
                 joined_kind: int, join: bool = True) -> None:
        self._protocol = protocol
        self._releases = releases
        self._ids = ids
        self._request_arena = request_arena
        self._response_arena = response_arena
        self._infer_frame = infer_frame
        self._joined_frame = joined_frame
        self._answer_kind = answer_kind
        self._joined_kind = joined_kind
        self._join = join
        self._sent: dict[int, _Sent] = {}
        self._waiting: list[tuple[Hashable, InferRequest, asyncio.Future[Answer]]] = []
        self._scheduled = False
        protocol.closed.add_done_callback(self._lost)

    async def infer(self, request: InferRequest, routing_key: str | None = None) -> Answer:
        """The server process's answer; :class:`Refused` with its error frame instead."""
        if self._protocol.closed.done():
            raise Refused(LOST)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Answer] = loop.create_future()
        key = join_key(request, routing_key) if self._join and (self._sent or self._waiting) else None
        if key is None:
            payload = encode_request(request, self._request_arena, routing_key)
            call = next(self._ids)
            self._sent[call] = _Sent(future, 0, request.id)
            self._protocol.send(self._releases.take() + self._infer_frame(call, payload))
        else:
            self._waiting.append((key, request, future))
            if not self._scheduled:
                self._scheduled = True
                loop.call_soon(self._flush)
        try:
            return await future
        except asyncio.CancelledError:  # an answer that came just before still holds its outputs' slot
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result()[1]()
            raise

    def on_frame(self, call: int, kind: int, payload: bytes) -> bool:
        """Take an infer call's answer or error; False when ``call`` is no infer call of this worker's."""
        if kind == self._joined_kind:
            self._joined_answer(call, payload)
            return True
        sent = self._sent.pop(call, None)
        if sent is None:
            return False
        if kind == self._answer_kind:
            if sent.future.done():  # its client went away: nobody reads the outputs
                self._give_back(response_slot(payload))
            else:
                response, slot = decode_response(payload, self._response_arena)
                sent.future.set_result((response, functools.partial(self._give_back, slot)))
        elif not sent.future.done():
            sent.future.set_exception(Refused(kind, payload))
        return True

    def _joined_answer(self, call: int, payload: bytes) -> None:
        response, slot, members = decode_answer(payload, self._response_arena)
        if any(call + index not in self._sent for index in range(members)):  # not ours (a confused peer)
            self._give_back(slot)
            return
        present = [self._sent.pop(call + index) for index in range(members)]
        try:
            answers = split_response(response, [s.rows for s in present], [s.request_id for s in present])
        except Exception as exc:  # raised here it would close the link: it is these members' answer instead
            self._give_back(slot)
            failure = InternalError(f"the server process's answer to {members} joined requests could not be split "
                                    f"by member: {exc}")
            for s in present:
                if not s.future.done():
                    s.future.set_exception(failure)
            return
        live = [(s.future, answer) for s, answer in zip(present, answers, strict=True) if not s.future.done()]
        if slot is None or not live:  # inline outputs, or every member's client went away
            self._give_back(slot)
            release: Callable[[], None] = _nothing
        else:
            release = _SharedSlot(slot, len(live), self._releases.add).release
        for future, answer in live:
            future.set_result((answer, release))

    def _flush(self) -> None:
        """The end of the turn: the requests waiting leave, joined by key."""
        self._scheduled = False
        waiting, self._waiting = self._waiting, []
        groups: dict[Hashable, list[tuple[InferRequest, asyncio.Future[Answer]]]] = {}
        for key, request, future in waiting:
            if not future.done():  # its client went away meanwhile
                groups.setdefault(key, []).append((request, future))
        if self._protocol.closed.done():
            for members in groups.values():
                for _, future in members:
                    future.set_exception(Refused(LOST))
            return
        out = [self._releases.take()]
        for members in groups.values():
            for start in range(0, len(members), MAX_MEMBERS):
                out.append(self._send(members[start:start + MAX_MEMBERS]))
        self._protocol.send(b"".join(out))

    def _send(self, members: list[tuple[InferRequest, asyncio.Future[Answer]]]) -> bytes:
        calls = [next(self._ids) for _ in members]  # consecutive: nothing else takes an id meanwhile
        try:
            if len(members) == 1:
                data = self._infer_frame(calls[0], encode_request(members[0][0], self._request_arena))
            else:
                data = self._joined_frame(calls[0], encode_joined([r for r, _ in members], self._request_arena))
        except Exception as exc:  # the caller's answer, as when a request failed to encode on its own
            for _, future in members:
                future.set_exception(exc)
            return b""
        for call, (request, future) in zip(calls, members, strict=True):
            self._sent[call] = _Sent(future, rows_of(request), request.id)
        return data

    def _give_back(self, slot: int | None) -> None:
        if slot is not None:
            self._releases.add(slot)

    def _lost(self, _: object) -> None:
        for sent in self._sent.values():
            if not sent.future.done():
                sent.future.set_exception(Refused(LOST))
        self._sent.clear()
