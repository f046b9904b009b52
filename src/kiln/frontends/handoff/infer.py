"""The server process's answer to one worker's decoded infer requests, whichever frontend the worker serves.

A request arrives as a descriptor (tensors.py) whose inputs lie in the worker's arena; it becomes an InferRequest
of numpy views on that arena (no copy), the Server answers it, and the outputs go into this side's arena. The
link around it (HTTP's or gRPC's frames) only frames the answer descriptor or renders the typed error.

A joined request (several clients' requests, kiln.v2.joined) runs as one where the Server allows it, in chunks of
at most the model's max_batch_size rows; otherwise, or where a chunk is refused as invalid or finds the queue too
full for all of it (max_queue_size), each member runs on its own, so each client gets the answer or the error of
its own request. A joined request whose tensors lie in its members' shared-memory regions runs each member on its
own also when a region fails it (unknown, busy, gone, too small, of CUDA kind): that may be one member's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import orjson

from kiln.errors import (
    ErrorCode,
    InvalidArgumentError,
    KilnError,
    NotFoundError,
    QueueFullError,
    UnavailableError,
    UnsupportedError,
    error_for_code,
)
from kiln.frontends.handoff.arena import Arena
from kiln.frontends.handoff.frames import unpack_offsets
from kiln.frontends.handoff.tensors import Member, decode_joined, decode_request, encode_response, member_count
from kiln.server.server import Server
from kiln.v2.joined import slice_request
from kiln.v2.status import as_kiln_error
from kiln.v2.types import InferRequest, InferResponse

Route = Callable[[InferRequest, str], None]
"""Applies a request's routing key (HTTP's routing header) before the Server sees it."""
JoinedAnswer = tuple[int, "bytes | KilnError", int]
"""(a member's index, the descriptor answering ``members`` requests from it on or that member's error, members)"""
Translate = Callable[[Exception], Exception]
"""Turns a failure into the error the frontend reports in one process (gRPC's ModelInfer words a decoupled model
its own way)."""


class InferHandoff:
    """One worker's infer requests. ``request_arena`` is the worker's (inputs), ``response_arena`` this side's
    (outputs); either is None where the platform gave none, and tensors then travel inline. ``release`` hands an
    input slot back to the worker once the last view of it is gone."""

    def __init__(self, server: Server, request_arena: Arena | None, response_arena: Arena | None,
                 release: Callable[[int], None], *, route: Route | None = None,
                 translate: Translate | None = None) -> None:
        self._server = server
        self._request_arena = request_arena
        self._response_arena = response_arena
        self._release = release
        self._route = route
        self._translate = translate
        # Inputs lie in the worker's arena: a GPU engine may copy them to the device from there.
        self._shared = server.share_host_memory(request_arena.buffer) if request_arena is not None else None

    async def answer(self, payload: bytes) -> bytes | KilnError:
        """The answer's descriptor, or the typed error the client is to see."""
        try:
            request, routing_key = decode_request(payload, self._request_arena, self._release)
            if routing_key is not None and self._route is not None:
                self._route(request, routing_key)
        except Exception as exc:  # every failure is the client's answer, rendered by the worker
            return self._error(exc)
        return await self._answer(request)

    async def answer_joined(self, payload: bytes) -> list[JoinedAnswer]:
        """The answers to a joined request's members: (the first member's index, the descriptor of an answer to
        ``members`` of them from there on, or the error of that one member, members)."""
        try:
            request, members = decode_joined(payload, self._request_arena, self._release)
        except Exception as exc:  # a descriptor this side cannot read: every member gets the error
            return [(index, self._error(exc), 1) for index in range(member_count(payload))]
        try:
            chunks = _chunks([member.rows for member in members], self._server.joined_rows(request))
            if len(chunks) == 1:  # the usual case: no gather (it costs a task per chunk)
                return await self._chunk(request, members, *chunks[0])
            answered = await asyncio.gather(*(self._chunk(request, members, first, stop, start, end)
                                              for first, stop, start, end in chunks))
        except Exception as exc:  # a fault of this side's: every member still gets an answer, not a wait forever
            error = self._error(exc)
            return [(index, error, 1) for index in range(len(members))]
        return [answer for part in answered for answer in part]

    async def _chunk(self, request: InferRequest, members: list[Member], first: int, stop: int,
                     start: int, end: int) -> list[JoinedAnswer]:
        """Members ``first:stop`` (rows ``start:end``): as one request when there are several, else on its own."""
        if stop - first > 1:
            try:
                held = sum(member.held for member in members[first:stop])
                response = await self._server.infer(slice_request(request, start, end, stop - first, "", first, held))
            except InvalidArgumentError as exc:
                if not exc.before_running and not request.member_rows:
                    # the model ran and refused the batch: the same for each, as in any batch
                    error = self._error(exc)
                    return [(index, error, 1) for index in range(first, stop)]
                # refused before running, or a member's region refused its rows: what is wrong may be one member's;
                # each runs on its own, gets its own answer
            except QueueFullError:
                pass  # the queue has room for fewer: each member queues on its own, as it would have unjoined
            except (NotFoundError, UnavailableError, UnsupportedError) as exc:
                if not request.member_rows:  # the same failure for each
                    error = self._error(exc)
                    return [(index, error, 1) for index in range(first, stop)]
                # one member's region may be gone, busy or of another kind: each runs on its own
            except Exception as exc:  # the same failure for each (the model, its engine, the server)
                error = self._error(exc)
                return [(index, error, 1) for index in range(first, stop)]
            else:
                if _rows_split(response, end - start):
                    return [(first, encode_response(response, self._response_arena, stop - first), stop - first)]
                # an output whose first dimension is not the rows cannot be cut by member: each runs on its own
        parts = []
        row = start
        for index, member in enumerate(members[first:stop], first):
            parts.append(slice_request(request, row, row + member.rows, 1, member.id, index, int(member.held)))
            row += member.rows
        answers = await asyncio.gather(*(self._answer(part) for part in parts))
        return [(index, answer, 1) for index, answer in enumerate(answers, first)]

    async def _answer(self, request: InferRequest) -> bytes | KilnError:
        try:
            response = await self._server.infer(request)
            return encode_response(response, self._response_arena)
        except Exception as exc:  # every failure is the client's answer, rendered by the worker
            return self._error(exc)

    def _error(self, exc: Exception) -> KilnError:
        return as_kiln_error(self._translate(exc) if self._translate is not None else exc)

    def free(self, payload: bytes) -> None:
        """The worker is done with these output slots (a RELEASE frame's payload)."""
        if self._response_arena is not None:
            for offset in unpack_offsets(payload):
                self._response_arena.free(offset)

    def close(self) -> None:
        """The worker is gone: unmap both arenas (once the last views of them are gone)."""
        if self._shared is not None:
            self._shared.close()
        for arena in (self._request_arena, self._response_arena):
            if arena is not None:
                arena.close()


def _rows_split(response: InferResponse, rows: int) -> bool:
    """Every output holds ``rows`` rows along its first dimension, so the worker can hand each member its own."""
    return all(len(o.shape) >= 1 and o.shape[0] == rows for o in response.outputs)


def _chunks(rows: list[int], limit: int) -> list[tuple[int, int, int, int]]:
    """Members in order, cut into runs of at most ``limit`` rows (0: one member per run), as (first member, stop
    member, first row, stop row)."""
    chunks = []
    first = start = end = 0
    for index, count in enumerate(rows):
        if index > first and end + count - start > limit:
            chunks.append((first, index, start, end))
            first, start = index, end
        end += count
    chunks.append((first, len(rows), start, end))
    return chunks


def error_payload(error: KilnError) -> bytes:
    """An ERROR frame's payload: the error's code and message."""
    return orjson.dumps([error.code.value, error.message])


def error_from_payload(payload: bytes) -> KilnError:
    code, message = orjson.loads(payload)
    return error_for_code(ErrorCode(code), message)
