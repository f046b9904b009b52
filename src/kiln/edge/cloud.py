"""The edge's client to the cloud: a KServe V2 HTTP server (``kiln serve``, Triton) that answers forwarded requests.

Requests go out with the binary tensor data extension, built and decoded by :mod:`kiln.bench.targets.wire`. The
transport is the standard library's ``http.client`` with one keep-alive connection per calling thread: the edge
calls from request threads and the shadow pool, and ``http.client`` connections are not shared between threads.
An ``https://`` URL makes them TLS connections (:mod:`kiln.edge.tls`); a TLS failure counts as unreachable.

The client never raises for a cloud problem: :class:`CloudResult` says whether the cloud answered, could not be
reached (connection refused, timeout, broken connection), or answered with an error.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.bench.targets.wire import HEADER_LENGTH, decode_http_response, http_body
from kiln.edge.tls import cloud_endpoint, split_url
from kiln.errors import KilnError
from kiln.tensor import DataType

Array = npt.NDArray[Any]

ANSWERED = "answered"
UNREACHABLE = "unreachable"
FAILED = "failed"  # the cloud was reached and answered with an error


@dataclass(frozen=True)
class CloudResult:
    status: str
    outputs: dict[str, Array] | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == ANSWERED


class CloudClient:
    """Sends one model's infer requests to ``url`` (``host:port``, ``http://host:port`` or ``https://host:port``;
    ``tls`` is the SSL context of https connections, see :func:`kiln.edge.tls.client_context`)."""

    def __init__(self, url: str, model: str, *, version: str = "", timeout_s: float = 5.0,
                 api_key: str | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.endpoint = cloud_endpoint(url, tls)
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self.version = version
        self.timeout_s = timeout_s
        quoted = urllib.parse.quote(model, safe="")
        self.path = f"/v2/models/{quoted}" + (f"/versions/{version}" if version else "") + "/infer"
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: set[http.client.HTTPConnection] = set()

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def tls(self) -> ssl.SSLContext | None:
        return self.endpoint.context

    def use_tls(self, context: ssl.SSLContext) -> None:
        """Connect with ``context`` from now on (an https URL only); call it when no request is in flight."""
        self.endpoint = cloud_endpoint(self.url, context)
        self.close()

    def infer(self, inputs: Mapping[str, npt.ArrayLike]) -> CloudResult:
        arrays = {name: np.asarray(value) for name, value in inputs.items()}
        datatypes = {name: DataType.from_numpy(array.dtype) for name, array in arrays.items()}
        body, headers = http_body(arrays, datatypes, binary_input=True, binary_output=True)
        headers = {**headers, **self._auth}
        try:
            status, response_headers, data = self._post(body, headers)
        except (OSError, http.client.HTTPException) as exc:
            self._drop_connection()
            return CloudResult(UNREACHABLE, error=f"{self.url}{self.path}: {type(exc).__name__}: {exc}"
                                                  f"{self._tls_hint(exc)}")
        if status != 200:
            return CloudResult(FAILED, error=f"{self.url}{self.path} answered {status}: {_error_text(data)}")
        length = response_headers.get(HEADER_LENGTH.lower())
        try:
            outputs = decode_http_response(data, int(length) if length is not None else None)
        except (KilnError, ValueError, KeyError, TypeError) as exc:
            return CloudResult(FAILED, error=f"{self.url}{self.path}: undecodable response ({exc})")
        return CloudResult(ANSWERED, outputs)

    def _tls_hint(self, exc: Exception) -> str:
        # With TLS 1.3 a server that refuses the client certificate does so after the handshake: the client sees
        # the session end (EOF, reset or no response) rather than a certificate error.
        ended = (ssl.SSLEOFError, ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected)
        if self.tls is None or not isinstance(exc, ended):
            return ""
        return " (the server ended the TLS session: it may require a client certificate this edge lacks or " \
               "that it does not trust)"

    def _post(self, body: bytes, headers: Mapping[str, str]) -> tuple[int, dict[str, str], bytes]:
        connection, reused = self._connection()
        try:
            return _exchange(connection, self.path, body, headers)
        except (ConnectionError, http.client.BadStatusLine):
            if not reused:
                raise
            self._drop_connection()
            connection, _ = self._connection()
            return _exchange(connection, self.path, body, headers)

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection, and whether it was used before."""
        connection: http.client.HTTPConnection | None = getattr(self._local, "connection", None)
        if connection is not None:
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


def _exchange(connection: http.client.HTTPConnection, path: str, body: bytes,
              headers: Mapping[str, str]) -> tuple[int, dict[str, str], bytes]:
    connection.request("POST", path, body=body, headers=dict(headers))
    response = connection.getresponse()
    data = response.read()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, data


def parse_url(url: str) -> tuple[str, int]:
    """(host, port) of a cloud URL; :func:`kiln.edge.tls.split_url` also gives the scheme."""
    _, host, port = split_url(url)
    return host, port


def _error_text(data: bytes) -> str:
    try:
        doc = json.loads(data)
    except ValueError:
        return data[:200].decode("utf-8", "replace")
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return str(doc["error"])
    return data[:200].decode("utf-8", "replace")
