"""uvicorn as kiln's HTTP frontends run it, in the server process and in HTTP worker processes alike."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

from kiln.frontends.http import listener
from kiln.frontends.http.infer_lane import InferLane, lane_protocol_class
from kiln.frontends.http.limits import HttpLimits, protocol_class
from kiln.frontends.http.shares import ConnectionShares

log = logging.getLogger("kiln.service")


class HttpServer(uvicorn.Server):
    """uvicorn without its own signal handling (the process owns signals for all its frontends) and with kiln's
    listener, which accepts connections in bursts (listener.py). ``sockets``: listening sockets bound already
    (an HTTP worker's); None binds the config's host and port."""

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket] | None = None,
                 shares: ConnectionShares | None = None) -> None:
        super().__init__(config)
        self._sockets = sockets
        self._shares = shares

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        config = self.config
        bound = self._sockets
        if bound is None:
            try:
                bound = listener.bind(config.host, config.port, config.backlog)
            except OSError as exc:
                log.error("cannot listen on %s:%d: %s", config.host, config.port, exc)
                raise SystemExit(1) from None
        await super().startup(sockets=[])  # uvicorn's state, without a server of its own
        limits: HttpLimits | None = getattr(config.http_protocol_class, "limits", None)
        if self._shares is not None:  # before the first connection: protocols keep the set they find here
            self.server_state.connections = listener.CountedConnections(lambda: accepting.publish())
        accepting = listener.Listener(
            bound, self._protocol, config.ssl, burst=config.backlog,
            max_connections=limits.max_connections if limits is not None else None,
            open_connections=lambda: len(self.server_state.connections), shares=self._shares)
        self.servers.append(accepting)  # type: ignore[arg-type]

    def _protocol(self) -> asyncio.Protocol:
        return self.config.http_protocol_class(config=self.config, server_state=self.server_state,  # type: ignore[call-arg]
                                               app_state=self.lifespan.state)


def http_config(app: Any, host: str, port: int, exit_timeout_s: float, *, certfile: Path | None = None,
                keyfile: Path | None = None, client_ca: Path | None = None,
                limits: HttpLimits | None = None, lane: InferLane | None = None) -> uvicorn.Config:
    """uvicorn's settings for a kiln frontend; with ``certfile`` it serves TLS, with ``client_ca`` it requires
    client certificates signed by that CA (mTLS); ``limits``: the connection limits and timeouts (limits.py;
    default :class:`HttpLimits`' defaults); ``lane``: the infer lane (infer_lane.py), None for none."""
    tls: dict[str, Any] = {}
    if certfile is not None:
        tls = {"ssl_certfile": str(certfile), "ssl_keyfile": str(keyfile) if keyfile else None}
        if client_ca is not None:
            tls |= {"ssl_ca_certs": str(client_ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}
    limits = limits or HttpLimits()
    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                          http=protocol_class(limits) if lane is None else lane_protocol_class(limits, lane),
                          loop="none",
                          timeout_keep_alive=limits.idle_timeout_s,  # type: ignore[arg-type]  # a float works (call_later)
                          timeout_graceful_shutdown=int(exit_timeout_s), **tls)
