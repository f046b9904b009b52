"""Where a V2 server listens, and the SSL context of its https connections.

A URL is ``host:port``, ``http://host:port`` or ``https://host:port``. An https endpoint verifies the server
against ``ca`` (default: the system's trusted CAs) and its certificate must name the URL's host; a client
certificate (``cert``, with ``key`` unless the cert file holds the key too) answers a server that requires one
(``kiln serve --https-client-ca``: mTLS).
"""

from __future__ import annotations

import http.client
import ssl
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import ConfigError


@dataclass(frozen=True)
class Endpoint:
    """Where the server listens; ``context`` is set exactly when the scheme is https."""

    scheme: str
    host: str
    port: int
    context: ssl.SSLContext | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def connection(self, timeout_s: float) -> http.client.HTTPConnection:
        """A new (not yet connected) connection to the server."""
        if self.context is not None:
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout_s, context=self.context)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)


def split_url(url: str, what: str = "url") -> tuple[str, str, int]:
    """(scheme, host, port) of ``host:port``, ``http://host:port`` or ``https://host:port``; errors call the URL
    ``what`` (e.g. "cloud url")."""
    parsed = urllib.parse.urlsplit(url if "//" in url else f"http://{url}")
    if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path not in ("", "/"):
        raise ConfigError(f"{what} '{url}' is not of the form host:port, http://host:port or https://host:port")
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError:
        raise ConfigError(f"{what} '{url}' has an invalid port") from None
    return parsed.scheme, parsed.hostname, port


def endpoint(url: str, context: ssl.SSLContext | None = None, what: str = "url") -> Endpoint:
    """The endpoint of ``url``; an https URL without ``context`` verifies the server against the system's CAs."""
    scheme, host, port = split_url(url, what)
    if scheme == "http" and context is not None:
        raise ConfigError(f"{what} '{url}' is plain http, but TLS settings were given (use https://{host}:{port})")
    if scheme == "https" and context is None:
        context = tls_context()
    return Endpoint(scheme, host, port, context)


def tls_context(ca: Path | None = None, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    """A client context that verifies the server (against ``ca`` when given) and presents ``cert`` if given."""
    if key is not None and cert is None:
        raise ConfigError(f"TLS: a client key ('{key}') needs its client certificate (cert)")
    for what, path in (("CA", ca), ("client certificate", cert), ("client key", key)):
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"TLS: the {what} '{path}' is not a file")
    try:
        context = ssl.create_default_context(cafile=str(ca) if ca is not None else None)
        if cert is not None:
            context.load_cert_chain(str(cert), str(key) if key is not None else None)
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"TLS: cannot load ca '{ca}', cert '{cert}', key '{key}': {exc}") from None
    return context
