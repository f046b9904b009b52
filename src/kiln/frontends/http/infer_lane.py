"""Infer requests answered from the connection's own callbacks, without an ASGI task: in an HTTP worker and in the
server process alike.

uvicorn runs every request as a task of the ASGI app: the task starts when the head is in, sleeps until the body
is, wakes to decode it, sleeps again until the answer comes and wakes once more to write the response. An infer
request that decodes on its own needs none of that: :class:`LaneProtocol` decodes it and hands it on in the
callback that completes its body (a worker's to the server process, :class:`ServerCore` to the Server of this
process), and writes the answer in the callback that receives it. The bytes on the wire are the ASGI path's: the
same codec, the same Response objects, uvicorn's default headers, its keep-alive and pipelining rules.

A request takes the lane when its head says it can: ``POST`` to an infer route, a ``Content-Length`` within
``--http-max-input-size``, no ``Content-Encoding``, no chunked body, no ``Expect: 100-continue``, and no access
restriction on inference. Everything else, and a request whose body turns out to need the model's metadata (a raw
body without a JSON header, or one that does not decode: the app says first whether the model exists), runs as an
ASGI task of the app (in a worker :class:`~kiln.frontends.http.worker_app.WorkerApp`, which forwards it to the
server process) with its body already read.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle

from kiln.errors import InvalidArgumentError
from kiln.frontends.access import AccessPolicy, http_group
from kiln.frontends.handoff.calls import Answer
from kiln.frontends.http.app import _infer_params
from kiln.frontends.http.endpoints import infer_over_http, render
from kiln.frontends.http.limits import HttpLimits, LimitedHttpToolsProtocol
from kiln.frontends.http.routing import ROUTING_KEY_HEADER, apply_routing_key
from kiln.frontends.http.worker_app import WorkerApp
from kiln.v2 import http_codec as codec
from kiln.v2.http_responses import error_response
from kiln.v2.types import InferRequest, InferResponse

if TYPE_CHECKING:
    from kiln.server.server import Server

log = logging.getLogger("kiln.http")

LANE_VARIABLE = "KILN_HTTP_INFER_LANE"
"""Set to 0 (or false, no, off) in `kiln serve`'s environment, which its workers inherit, to answer every request
as an ASGI task (to compare, or to rule the lane out)."""

_HEADER_LENGTH = codec.HEADER_LENGTH.encode()
_ROUTING_KEY = ROUTING_KEY_HEADER.encode()
_NOT_ON_LANE = (b"content-encoding", b"transfer-encoding")
Respond = Callable[[RequestResponseCycle, Response], None]


def lane_enabled() -> bool:
    """What this worker's environment says about the lane (on unless ``KILN_HTTP_INFER_LANE`` turns it off)."""
    return os.environ.get(LANE_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


class LaneCore(Protocol):
    """Where the lane's requests go: the server process's link in a worker (:class:`CoreClient`), the Server
    itself in the server process (:class:`ServerCore`). ``submit`` gives a future that only ``result`` reads."""

    def submit(self, request: InferRequest, routing_key: str | None) -> asyncio.Future[Any]: ...

    def result(self, future: asyncio.Future[Any]) -> Answer: ...

    def typed(self, exc: Exception) -> Exception: ...


def _nothing_to_release() -> None:
    pass


class ServerCore:
    """The Server of this process as the lane's core: HTTP served from the server process itself."""

    def __init__(self, server: Server) -> None:
        self._server = server

    def submit(self, request: InferRequest, routing_key: str | None) -> asyncio.Future[InferResponse]:
        apply_routing_key(self._server, routing_key, request)
        return asyncio.ensure_future(infer_over_http(self._server, request))

    def result(self, future: asyncio.Future[InferResponse]) -> Answer:
        return future.result(), _nothing_to_release  # the response owns its outputs

    @staticmethod
    def typed(exc: Exception) -> Exception:
        return exc


class InferLane:
    """Decides which requests take the lane and answers them, as the ASGI app would: through ``core``, within
    ``max_input_size``; inference restricted by ``access`` never takes the lane."""

    def __init__(self, core: LaneCore, max_input_size: int, access: AccessPolicy | None) -> None:
        self._core = core
        self._max_input_size = max_input_size
        group = http_group("POST", "/v2/models/m/infer")
        self.open = not (access and group is not None and access.header(group) is not None)
        self.taken = 0  # requests answered on the lane

    @classmethod
    def of_worker(cls, app: WorkerApp) -> InferLane:
        """The lane of an HTTP worker whose ASGI app is ``app``."""
        return cls(app.core, app.max_input_size, app.access)

    def accepts(self, cycle: RequestResponseCycle) -> bool:
        """Whether the head lets this request take the lane."""
        scope = cycle.scope
        if not self.open or scope["method"] != "POST" or cycle.waiting_for_100_continue:
            return False
        if _infer_params(scope) is None:  # type: ignore[arg-type]
            return False
        declared = b""
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = value
            elif name in _NOT_ON_LANE:
                return False
        return declared.isdigit() and int(declared) <= self._max_input_size

    def take(self, cycle: RequestResponseCycle, respond: Respond) -> bool:
        """Send the request to the server process and answer it through ``respond(cycle, response)`` later;
        False when it must run as an ASGI task instead (nothing has been sent then)."""
        scope = cycle.scope
        params = _infer_params(scope)  # type: ignore[arg-type]
        assert params is not None  # accepts() said so
        body = cycle.body if isinstance(cycle.body, bytes) else bytes(cycle.body)
        header_length = routing_key = None
        for name, value in scope["headers"]:
            if name == _HEADER_LENGTH:
                header_length = value.decode("latin-1")
            elif name == _ROUTING_KEY:
                routing_key = value.decode("latin-1")
        try:
            json_size = codec.header_length(header_length, len(body))
        except InvalidArgumentError as exc:
            respond(cycle, error_response(exc))
            return True
        if json_size == 0:  # raw body: decoding needs the model's metadata, which the ASGI path looks up
            return False
        try:
            request = codec.decode_request(params["model"], params.get("version", ""), body, json_size)
        except InvalidArgumentError:  # the ASGI path says first whether the model exists
            return False
        cycle.body = b""  # type: ignore[assignment]  # the request's views hold what they need of it
        try:
            future = self._core.submit(request, routing_key)
        except Exception as exc:
            respond(cycle, error_response(self._core.typed(exc)))
            return True
        future.add_done_callback(functools.partial(self._answered, cycle, request, respond))
        self.taken += 1
        return True

    def _answered(self, cycle: RequestResponseCycle, request: InferRequest, respond: Respond,
                  future: asyncio.Future[Any]) -> None:
        try:
            answer, release = self._core.result(future)
        except Exception as exc:
            respond(cycle, error_response(exc))
            return
        try:
            if cycle.disconnected:
                return
            response = render(answer, request)
        except Exception as exc:  # as the ASGI path's guard answers it
            response = error_response(exc)
        finally:
            release()  # the body holds a copy of every output now
        respond(cycle, response)


class LaneProtocol(LimitedHttpToolsProtocol):
    """:class:`LimitedHttpToolsProtocol` whose requests take ``lane`` where they can (class attribute; see
    :func:`lane_protocol_class`)."""

    lane: InferLane | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lane_cycle: RequestResponseCycle | None = None  # on the lane, its body not complete yet
        self._pieces: list[bytes] = []  # the lane cycle's body as it came
        self._resume_soon = False

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        lane = self.lane
        if lane is None or not lane.accepts(cycle):
            super()._start_asgi_task(cycle, app)
        elif cycle.more_body:
            self._lane_cycle = cycle  # taken when its body is complete
            self.flow.resume_reading()  # no task will read the body: whatever paused reading must not hold it
        else:
            self._take(cycle, app)

    def on_body(self, body: bytes) -> None:
        if self._lane_cycle is None or self.cycle is not self._lane_cycle:
            super().on_body(body)
            return
        # Kept apart and joined once complete: the cycle's body grows by copying (no task drains it here), which
        # for a large body in many pieces copies it over and over.
        self._pieces.append(body)
        if not self._resume_soon:
            # No task reads the body, so reading goes on from here; a turn later, not at once: the rest of a large
            # body is then mostly in and comes in a few reads, where at once it comes in many small ones (a bare
            # httptools server reading on at once spent 2.6x the CPU per 301 KB request at 16 connections,
            # ceilings.py).
            self.flow.pause_reading()
            self._resume_soon = True
            self.loop.call_soon(self._read_on)

    def _read_on(self) -> None:
        self._resume_soon = False
        if self._lane_cycle is not None and self.cycle is self._lane_cycle:
            self.flow.resume_reading()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        cycle = self._lane_cycle
        if cycle is not None and cycle is self.cycle and not cycle.more_body:
            self._lane_cycle = None
            self._take(cycle, self.app)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lane_cycle = None
        self._pieces = []
        super().connection_lost(exc)

    def _take(self, cycle: RequestResponseCycle, app: Any) -> None:
        assert self.lane is not None
        if self._pieces:  # after what came before the lane took the cycle (a pipelined request's first pieces)
            pieces = [bytes(cycle.body), *self._pieces] if cycle.body else self._pieces
            cycle.body = pieces[0] if len(pieces) == 1 else b"".join(pieces)  # type: ignore[assignment]
            self._pieces = []
        try:
            taken = self.lane.take(cycle, self._respond)
        except Exception:  # a fault of the lane's own: the ASGI path answers the request as ever
            log.exception("HTTP worker: an infer request's lane failed; answering it as an ASGI task")
            taken = False
        if not taken:
            super()._start_asgi_task(cycle, app)

    def _respond(self, cycle: RequestResponseCycle, response: Response) -> None:
        """Write ``response`` as uvicorn's cycle would (its default headers, ``connection: close`` when the
        connection ends with it) and complete the cycle."""
        if cycle.disconnected or cycle.response_complete or self.transport.is_closing():
            return  # the client has gone (a pipelined request after this one may be the cycle it marked)
        cycle.response_started = cycle.response_complete = True
        head = [STATUS_LINE[response.status_code]]
        for name, value in (*cycle.default_headers, *response.raw_headers):
            head += (name, b": ", value, b"\r\n")
        if not cycle.keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        self.transport.writelines([b"".join(head), response.body])
        if not cycle.keep_alive:
            self.transport.close()
        cycle.on_response()


def lane_protocol_class(limits: HttpLimits, lane: InferLane) -> type[LaneProtocol]:
    """The protocol class uvicorn instantiates per connection, with ``limits`` and ``lane``."""
    return type("LaneProtocol", (LaneProtocol,), {"limits": limits, "lane": lane})
