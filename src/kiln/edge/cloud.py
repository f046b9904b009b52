"""The edge's client to the cloud: a KServe V2 HTTP server (``kiln serve``, Triton) that answers forwarded requests.

Requests go out with the binary tensor data extension through kiln's V2 client (:class:`kiln.v2.client.HttpClient`:
one keep-alive connection per calling thread, as the edge calls from request threads and the shadow pool). An
``https://`` URL makes them TLS connections (:mod:`kiln.edge.tls`); a TLS failure counts as unreachable.

The client never raises for a cloud problem: :class:`CloudResult` says whether the cloud answered, could not be
reached (connection refused, timeout, broken connection), or answered with an error.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.errors import KilnError
from kiln.v2.client import HttpClient, ServerUnreachableError, split_url
from kiln.v2.client.calls import model_path

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
        self.http = HttpClient(url, timeout_s=timeout_s, api_key=api_key, tls=tls, what="cloud url")
        self.model = model
        self.version = version
        self.timeout_s = timeout_s
        self.path = model_path(model, version) + "/infer"

    @property
    def url(self) -> str:
        return self.http.url

    @property
    def tls(self) -> ssl.SSLContext | None:
        return self.http.endpoint.context

    def use_tls(self, context: ssl.SSLContext) -> None:
        """Connect with ``context`` from now on (an https URL only); call it when no request is in flight."""
        self.http.use_tls(context)

    def infer(self, inputs: Mapping[str, npt.ArrayLike]) -> CloudResult:
        arrays = {name: np.asarray(value) for name, value in inputs.items()}
        try:
            response = self.http.infer(self.model, arrays, version=self.version)
        except ServerUnreachableError as exc:
            return CloudResult(UNREACHABLE, error=exc.message)
        except KilnError as exc:
            return CloudResult(FAILED, error=f"{self.url}{self.path}: {exc.message}")
        return CloudResult(ANSWERED, response.arrays())

    def close(self) -> None:
        """Close every thread's connection; call it when no request is in flight."""
        self.http.close()


def parse_url(url: str) -> tuple[str, int]:
    """(host, port) of a cloud URL; :func:`kiln.v2.client.split_url` also gives the scheme."""
    _, host, port = split_url(url, "cloud url")
    return host, port
