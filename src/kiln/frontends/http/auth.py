"""The API key of kiln's own extensions (model download, sample capture): ``Authorization: Bearer <key>``."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from kiln.errors import UnauthenticatedError


def require_key(headers: Mapping[str, str], key: str | None, what: str) -> None:
    """Pass when no key is set or ``headers`` carry ``Authorization: Bearer <key>``; else UnauthenticatedError
    naming ``what`` needs the key. The comparison takes the same time whatever the token."""
    if key is None:
        return
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
        return
    raise UnauthenticatedError(f"{what} needs the server's API key: send 'Authorization: Bearer <key>'")
