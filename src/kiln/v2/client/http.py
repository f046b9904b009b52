"""The blocking V2 HTTP client: any thread may call it; each thread keeps one keep-alive connection.

The transport is the standard library's ``http.client`` (nothing to install on an edge device), TLS for an
``https://`` URL (:func:`kiln.v2.client.endpoint.tls_context`), an optional API key sent as a bearer token.
Error answers raise the typed error they stand for (:mod:`kiln.v2.status`); a server that cannot be reached raises
:class:`ServerUnreachableError`.
"""

from __future__ import annotations

import http.client
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO, TypeVar

import numpy.typing as npt

from kiln.errors import UnavailableError
from kiln.tensor import DataType
from kiln.v2.client import calls
from kiln.v2.client.calls import Call, Response
from kiln.v2.client.endpoint import Endpoint, endpoint
from kiln.v2.types import InferResponse

T = TypeVar("T")


class ServerUnreachableError(UnavailableError):
    """No answer: connection refused, timed out or broken, or the TLS handshake failed."""


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class HttpClient:
    """A client of one server at ``url`` (``host:port``, ``http://...`` or ``https://...``; ``tls`` is the SSL
    context of https connections)."""

    def __init__(self, url: str, *, timeout_s: float = 60.0, api_key: str | None = None,
                 tls: ssl.SSLContext | None = None, what: str = "url") -> None:
        self.endpoint: Endpoint = endpoint(url, tls, what)
        self.timeout_s = timeout_s
        self.headers = auth_headers(api_key)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: set[http.client.HTTPConnection] = set()

    @property
    def url(self) -> str:
        return self.endpoint.url

    def use_tls(self, context: ssl.SSLContext) -> None:
        """Connect with ``context`` from now on (an https URL only); call it when no request is in flight."""
        self.endpoint = endpoint(self.url, context)
        self.close()

    # -- the API ---------------------------------------------------------------------------------------------

    def infer(self, model: str, inputs: Mapping[str, npt.NDArray[Any]], *, version: str = "",
              outputs: Sequence[str] = (), binary: bool = True, datatypes: Mapping[str, DataType] | None = None,
              parameters: Mapping[str, Any] | None = None, request_id: str = "") -> InferResponse:
        return self.send(calls.infer(model, inputs, version=version, outputs=outputs, binary=binary,
                                     datatypes=datatypes, parameters=parameters, request_id=request_id))

    def live(self) -> bool:
        return self.send(calls.live())

    def ready(self) -> bool:
        return self.send(calls.ready())

    def model_ready(self, model: str, version: str = "") -> bool:
        return self.send(calls.model_ready(model, version))

    def server_metadata(self) -> Any:
        return self.send(calls.server_metadata())

    def model_metadata(self, model: str, version: str = "") -> Any:
        return self.send(calls.model_metadata(model, version))

    def model_config(self, model: str, version: str = "") -> Any:
        return self.send(calls.model_config(model, version))

    def statistics(self, model: str = "", version: str = "") -> Any:
        return self.send(calls.statistics(model, version))

    def repository_index(self, ready_only: bool = False) -> Any:
        return self.send(calls.repository_index(ready_only))

    def load_model(self, model: str, config: str | None = None, files: Mapping[str, bytes] | None = None) -> None:
        self.send(calls.load_model(model, config, files))

    def unload_model(self, model: str, unload_dependents: bool = False) -> None:
        self.send(calls.unload_model(model, unload_dependents))

    def get(self, path: str) -> Any:
        """GET a JSON document from any route (extensions: edge files, captures, A/B routing)."""
        return self.send(calls.get(path))

    def post(self, path: str, doc: object = None) -> Any:
        return self.send(calls.post(path, doc))

    # -- transport ---------------------------------------------------------------------------------------------

    def send(self, call: Call[T]) -> T:
        return call.parse(self.request(call.method, call.path, call.body, call.headers))

    def request(self, method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None,
                ) -> Response:
        """One exchange, whatever the status. A kept-alive connection the server has meanwhile closed is
        reopened and the request sent again once: the server answered nothing on it, so nothing ran twice."""
        headers = {**self.headers, **(headers or {})}
        connection, reused = self._connection()
        try:
            try:
                return _exchange(connection, method, path, body, headers)
            except (ConnectionError, http.client.BadStatusLine):
                if not reused:
                    raise
                self._drop_connection()
                connection, _ = self._connection()
                return _exchange(connection, method, path, body, headers)
        except (OSError, http.client.HTTPException) as exc:
            self._drop_connection()
            raise ServerUnreachableError(f"{method} {self.url}{path}: {type(exc).__name__}: {exc}"
                                         f"{self._tls_hint(exc)}") from exc

    def download(self, path: str, sink: BinaryIO, chunk_size: int = 1 << 20) -> int:
        """GET ``path`` and write its body to ``sink`` (a binary file) in chunks; returns the bytes written.
        The connection is not kept (the body is read to its end, then closed)."""
        connection = self.endpoint.connection(self.timeout_s)
        try:
            connection.request("GET", path, headers=dict(self.headers))
            answer = connection.getresponse()
            if answer.status != 200:
                raise Response(answer.status, {}, answer.read()).error()
            written = 0
            while chunk := answer.read(chunk_size):
                sink.write(chunk)
                written += len(chunk)
            return written
        except (OSError, http.client.HTTPException) as exc:
            raise ServerUnreachableError(f"GET {self.url}{path}: {type(exc).__name__}: {exc}") from exc
        finally:
            connection.close()

    def _tls_hint(self, exc: Exception) -> str:
        # With TLS 1.3 a server that refuses the client certificate does so after the handshake: the client sees
        # the session end (EOF, reset or no response) rather than a certificate error.
        ended = (ssl.SSLEOFError, ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected)
        if self.endpoint.context is None or not isinstance(exc, ended):
            return ""
        return " (the server ended the TLS session: it may require a client certificate this client lacks or " \
               "that it does not trust)"

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection, and whether it was used before."""
        connection: http.client.HTTPConnection | None = getattr(self._local, "connection", None)
        with self._lock:
            # close() forgets every connection; one it closed must not quietly reconnect outside the set.
            if connection is not None and connection in self._connections:
                return connection, True
        connection = self.endpoint.connection(self.timeout_s)
        self._local.connection = connection
        with self._lock:
            self._connections.add(connection)
        return connection, False

    def _drop_connection(self) -> None:
        connection: http.client.HTTPConnection | None = getattr(self._local, "connection", None)
        self._local.connection = None
        if connection is not None:
            connection.close()
            with self._lock:
                self._connections.discard(connection)

    def close(self) -> None:
        """Close every thread's connection; call it when no request is in flight."""
        with self._lock:
            connections, self._connections = self._connections, set()
        for connection in connections:
            connection.close()

    def __enter__(self) -> HttpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _exchange(connection: http.client.HTTPConnection, method: str, path: str, body: bytes,
              headers: Mapping[str, str]) -> Response:
    connection.request(method, path, body=body or None, headers=dict(headers))
    sent_ns = time.monotonic_ns()
    answer = connection.getresponse()
    head_ns = time.monotonic_ns()
    data = answer.read()
    return Response(answer.status, {k.lower(): v for k, v in answer.getheaders()}, data, sent_ns, head_ns)
