"""HTTP access control: the restricted API groups (``--http-restricted-api``) and the API key of kiln's own
extensions (model download, sample capture: ``Authorization: Bearer <key>``)."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

from kiln.errors import PermissionDeniedError, UnauthenticatedError
from kiln.frontends.access import AccessPolicy, http_group
from kiln.v2.http_responses import error_response


def require_key(headers: Mapping[str, str], key: str | None, what: str) -> None:
    """Pass when no key is set or ``headers`` carry ``Authorization: Bearer <key>``; else UnauthenticatedError
    naming ``what`` needs the key. The comparison takes the same time whatever the token."""
    if key is None:
        return
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
        return
    raise UnauthenticatedError(f"{what} needs the server's API key: send 'Authorization: Bearer <key>'")


class RestrictedApi:
    """ASGI middleware answering 403 to a request for a restricted group that lacks the group's header and value
    (kiln/frontends/access.py); every other request goes on to ``app`` untouched. In front of the whole app, so
    the inference fast path (app.InferFirst) is checked too."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            group = http_group(scope["method"], scope["path"])
            if group is not None and self.policy.header(group) is not None:
                headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
                try:
                    self.policy.check(group, headers)
                except PermissionDeniedError as exc:
                    await error_response(exc)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def restricted(app: ASGIApp, policy: AccessPolicy | None) -> ASGIApp:
    """``app`` behind the policy's restrictions; ``app`` itself when there are none (no cost per request)."""
    return RestrictedApi(app, policy) if policy else app
