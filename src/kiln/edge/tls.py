"""TLS for the edge-to-cloud link: the cloud's address and the SSL context every cloud connection uses.

An ``https://`` cloud URL makes every connection (forwarded requests, model sync, capture uploads) a TLS one,
through kiln's V2 client (:mod:`kiln.v2.client.endpoint`): the server is verified against ``ca`` (default: the
system's trusted CAs) and its certificate must name the URL's host. A client certificate (``cert``, with ``key``
unless the cert file holds the key too) answers a server that requires one (``kiln serve --https-client-ca``: mTLS).
"""

from __future__ import annotations

import ssl
from pathlib import Path

from kiln.v2.client.endpoint import Endpoint, endpoint, tls_context
from kiln.v2.client.endpoint import split_url as _split_url


def split_url(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of a cloud URL; errors name it the cloud url."""
    return _split_url(url, "cloud url")


def cloud_endpoint(url: str, context: ssl.SSLContext | None = None) -> Endpoint:
    return endpoint(url, context, "cloud url")


def client_context(ca: Path | None = None, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    """The SSL context of the edge's cloud connections (see :func:`kiln.v2.client.endpoint.tls_context`)."""
    return tls_context(ca, cert, key)
