"""The server process's answer to one worker's decoded infer requests, whichever frontend the worker serves.

A request arrives as a descriptor (tensors.py) whose inputs lie in the worker's arena; it becomes an InferRequest
of numpy views on that arena (no copy), the Server answers it, and the outputs go into this side's arena. The
link around it (HTTP's or gRPC's frames) only frames the answer descriptor or renders the typed error.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson

from kiln.errors import ErrorCode, KilnError, error_for_code
from kiln.frontends.handoff.arena import Arena
from kiln.frontends.handoff.frames import unpack_offsets
from kiln.frontends.handoff.tensors import decode_request, encode_response
from kiln.server.server import Server
from kiln.v2.status import as_kiln_error
from kiln.v2.types import InferRequest

Route = Callable[[InferRequest, str], None]
"""Applies a request's routing key (HTTP's routing header) before the Server sees it."""
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

    async def answer(self, payload: bytes) -> bytes | KilnError:
        """The answer's descriptor, or the typed error the client is to see."""
        try:
            request, routing_key = decode_request(payload, self._request_arena, self._release)
            if routing_key is not None and self._route is not None:
                self._route(request, routing_key)
            response = await self._server.infer(request)
            return encode_response(response, self._response_arena)
        except Exception as exc:  # every failure is the client's answer, rendered by the worker
            return as_kiln_error(self._translate(exc) if self._translate is not None else exc)

    def free(self, payload: bytes) -> None:
        """The worker is done with these output slots (a RELEASE frame's payload)."""
        if self._response_arena is not None:
            for offset in unpack_offsets(payload):
                self._response_arena.free(offset)

    def close(self) -> None:
        """The worker is gone: unmap both arenas (once the last views of them are gone)."""
        for arena in (self._request_arena, self._response_arena):
            if arena is not None:
                arena.close()


def error_payload(error: KilnError) -> bytes:
    """An ERROR frame's payload: the error's code and message."""
    return orjson.dumps([error.code.value, error.message])


def error_from_payload(payload: bytes) -> KilnError:
    code, message = orjson.loads(payload)
    return error_for_code(ErrorCode(code), message)
