"""A worker's infer requests to the server process and their answers, whichever frontend the worker serves.

A request that finds the worker idle (no infer call of its own outstanding) leaves at once: nothing could join it.
Otherwise it waits for the end of the event-loop turn, and the requests of that turn that share a join key
(kiln.v2.joined) leave together as one joined request: the server process then does its per-request work (reading
the descriptor, admission, validation, the batcher's queue, the answer's descriptor and frame) once for all of them,
which is what bounds a server fed by several worker processes (docs/serving.md, "HTTP workers").

Under load a turn holds few requests (the worker is not the busy process), so a key with ``hold`` calls already in
flight keeps its new requests until one of those calls is answered; they then leave as one. That starts only once
the worker has ``HOLD_FROM`` requests out: with fewer, the requests it would hold are the ones the server's batcher
puts into its next batch while the calls out run, and holding them back for an answer takes them out of it (behind
2-4 workers at 16 clients, a 1 ms device stand-in ran batches of 4 rows instead of 8 and answered 0.64x as many
requests; benchmarks/results/join_hold_from-dev2core-2026-12-05.txt). A key whose last joined request the server
process answered member by member is not held: for a model that runs its members one by one (no dynamic batching,
A/B weights), a held group would only wait for its slowest member. A key not seen yet is held, and its first
answer tells: requests that come one per loop turn (grpc.aio hands a worker its calls so) seldom join on their
own, so the joined request that shows the model batches them might never form. This is the batch the
server would have formed anyway while the earlier calls ran, formed where it costs nothing, and a lone client's
request still waits for nothing: with fewer than ``hold`` calls in flight it leaves at the end of its turn. No request
is held longer than ``MAX_HOLD_S``: a model whose batcher waits for company (a queue delay, preferred sizes) gets it
after that even while its calls in flight wait for the held requests.

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

from kiln.errors import ConfigError, InternalError
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


HOLD_VARIABLE = "KILN_JOIN_HOLD"
"""Calls in flight per join key before a worker holds that key's next requests for an answer (default
``DEFAULT_HOLD``); 0 sends them at the end of their event-loop turn whatever is in flight."""
DEFAULT_HOLD = 2  # one call running while the next one forms: the GPU is never left without the next batch
HOLD_FROM = 8
"""Requests a worker must have out (sent, not yet answered) before it holds any."""
MAX_HOLD_S = 0.001
MAX_KEYS = 1024


def joining_enabled() -> bool:
    """What this worker's environment says about joining (on unless ``KILN_JOIN_REQUESTS`` turns it off)."""
    return os.environ.get(JOIN_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


def join_hold() -> int:
    """What this process's environment says about holding (``KILN_JOIN_HOLD``); the server process reads it before
    it starts workers, so a bad value stops `kiln serve` rather than every worker."""
    value = os.environ.get(HOLD_VARIABLE, "").strip()
    if not value:
        return DEFAULT_HOLD
    if not value.isdigit():
        raise ConfigError(f"environment variable {HOLD_VARIABLE} is {value!r}; expected a whole number of calls in "
                          f"flight per model (0 never holds requests; default {DEFAULT_HOLD})")
    return int(value)


class Refused(Exception):
    """The server process answered with an error frame (its kind and payload, as the link words them), or the link
    is gone (kind ``LOST``)."""

    def __init__(self, kind: int, payload: bytes = b"") -> None:
        super().__init__(kind)
        self.kind = kind
        self.payload = payload


class _Group:
    """The members of one call (a joined request, or one request) under a join key: the key's call is in flight
    until each member is answered."""

    __slots__ = ("key", "members", "unanswered")

    def __init__(self, key: Hashable, members: int) -> None:
        self.key = key
        self.members = members
        self.unanswered = members


@dataclass
class _Sent:
    future: asyncio.Future[Answer]
    rows: int
    request_id: str
    group: _Group | None = None


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
    False sends every request on its own; ``hold`` is the calls in flight per join key past which new requests wait
    for an answer (0: never; benchmarks/handoff_ceiling.py measures each), for at most ``max_hold_s``, once the
    worker has ``hold_from`` requests out."""

    def __init__(self, protocol: FrameProtocol, releases: Releases, ids: Iterator[int], request_arena: Arena | None,
                 response_arena: Arena | None, *, infer_frame: Framer, joined_frame: Framer, answer_kind: int,
                 joined_kind: int, join: bool = True, hold: int = DEFAULT_HOLD,
                 max_hold_s: float = MAX_HOLD_S, hold_from: int = HOLD_FROM) -> None:
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
        self._hold = hold
        self._max_hold_s = max_hold_s
        self._hold_from = hold_from
        self._sent: dict[int, _Sent] = {}
        self._waiting: list[tuple[Hashable, InferRequest, asyncio.Future[Answer]]] = []
        self._held: set[asyncio.Future[Answer]] = set()  # waiting requests held back at a flush, by their future
        self._in_flight: dict[Hashable, int] = {}  # calls per join key not yet answered in full
        self._batches: dict[Hashable, bool] = {}  # per join key: its last joined request was answered as one
        self._scheduled = False
        self._hold_timer: asyncio.TimerHandle | None = None
        self._hold_over = False
        protocol.closed.add_done_callback(self._lost)

    async def infer(self, request: InferRequest, routing_key: str | None = None) -> Answer:
        """The server process's answer; :class:`Refused` with its error frame instead."""
        future = self.submit(request, routing_key)
        try:
            return await future
        except asyncio.CancelledError:  # an answer that came just before still holds its outputs' slot
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result()[1]()
            raise

    def submit(self, request: InferRequest, routing_key: str | None = None) -> asyncio.Future[Answer]:
        """Send ``request`` (or queue it for the end of the turn) without waiting: the future holds the answer, or
        :class:`Refused`. Whoever drops a future that got its answer must still call the answer's release."""
        if self._protocol.closed.done():
            raise Refused(LOST)
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        key = join_key(request, routing_key) if self._join else None
        if key is None or not (self._sent or self._waiting):
            payload = encode_request(request, self._request_arena, routing_key)
            call = next(self._ids)
            self._sent[call] = _Sent(future, 0, request.id, None if key is None else self._group(key, 1))
            self._protocol.send(self._releases.take() + self._infer_frame(call, payload))
        else:
            self._waiting.append((key, request, future))
            self._schedule_flush()
        return future

    def on_frame(self, call: int, kind: int, payload: bytes) -> bool:
        """Take an infer call's answer or error; False when ``call`` is no infer call of this worker's."""
        if kind == self._joined_kind:
            self._joined_answer(call, payload)
            return True
        sent = self._sent.pop(call, None)
        if sent is None:
            return False
        self._answered([sent])
        if kind == self._answer_kind and sent.group is not None and sent.group.members > 1:
            self._learn(sent.group.key, batches=False)  # a joined request's member answered on its own
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
        if present[0].group is not None:
            self._learn(present[0].group.key, batches=True)
        self._answered(present)
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

    def _group(self, key: Hashable, members: int) -> _Group:
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        return _Group(key, members)

    def _learn(self, key: Hashable, batches: bool) -> None:
        if len(self._batches) >= MAX_KEYS and key not in self._batches:
            self._batches.clear()  # keys hold shapes: a client varying them must not grow this without bound
        self._batches[key] = batches

    def _answered(self, sent: list[_Sent]) -> None:
        """Members answered: a call answered in full lets its key's held requests leave at the end of the turn."""
        for member in sent:
            group = member.group
            if group is None:
                continue
            group.unanswered -= 1
            if group.unanswered == 0:
                left = self._in_flight[group.key] - 1
                if left:
                    self._in_flight[group.key] = left
                else:
                    del self._in_flight[group.key]
                if self._waiting:
                    self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """The end of the turn: the requests waiting leave, joined by key, but for keys with ``hold`` calls in
        flight, which keep theirs until an answer (once ``hold_from`` requests are out)."""
        self._scheduled = False
        hold = 0 if self._hold_over or len(self._sent) < self._hold_from else self._hold
        self._hold_over = False
        waiting, self._waiting = self._waiting, []
        groups: dict[Hashable, list[tuple[InferRequest, asyncio.Future[Answer]]]] = {}
        for key, request, future in waiting:
            if not future.done():  # its client went away meanwhile
                groups.setdefault(key, []).append((request, future))
            else:
                self._held.discard(future)
        if self._protocol.closed.done():
            self._held.clear()
            for members in groups.values():
                for _, future in members:
                    future.set_exception(Refused(LOST))
            return
        out = [self._releases.take()]
        for key, members in groups.items():
            if hold and self._in_flight.get(key, 0) >= hold and self._batches.get(key, True):
                self._waiting.extend((key, request, future) for request, future in members)
                self._held.update(future for _, future in members)
                continue
            for start in range(0, len(members), MAX_MEMBERS):
                out.append(self._send(key, members[start:start + MAX_MEMBERS]))
        data = b"".join(out)
        if data:  # nothing when every request is held
            self._protocol.send(data)
        if not self._waiting and self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        elif self._waiting and self._hold_timer is None:
            self._hold_timer = asyncio.get_running_loop().call_later(self._max_hold_s, self._end_hold)

    def _end_hold(self) -> None:
        """``max_hold_s`` since requests were first held: the next flush sends them whatever is in flight."""
        self._hold_timer = None
        self._hold_over = True
        self._schedule_flush()

    def _send(self, key: Hashable, members: list[tuple[InferRequest, asyncio.Future[Answer]]]) -> bytes:
        calls = [next(self._ids) for _ in members]  # consecutive: nothing else takes an id meanwhile
        held = [future in self._held for _, future in members]  # counted by the server's statistics
        if any(held):
            self._held.difference_update(future for _, future in members)
        try:
            if len(members) == 1:
                data = self._infer_frame(calls[0], encode_request(members[0][0], self._request_arena, held=held[0]))
            else:
                data = self._joined_frame(calls[0], encode_joined([r for r, _ in members], self._request_arena,
                                                                  held))
        except Exception as exc:  # the caller's answer, as when a request failed to encode on its own
            for _, future in members:
                future.set_exception(exc)
            return b""
        group = self._group(key, len(members))
        for call, (request, future) in zip(calls, members, strict=True):
            self._sent[call] = _Sent(future, rows_of(request), request.id, group)
        return data

    def _give_back(self, slot: int | None) -> None:
        if slot is not None:
            self._releases.add(slot)

    def _lost(self, _: object) -> None:
        for sent in self._sent.values():
            if not sent.future.done():
                sent.future.set_exception(Refused(LOST))
        self._sent.clear()
        self._in_flight.clear()
        if self._waiting:  # held requests: the flush fails them
            self._schedule_flush()
