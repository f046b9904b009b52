"""A kiln extension for edges that capture samples for retraining.

``POST /v2/kiln/models/{name}/versions/{version}/capture`` takes one sample: the body is an npz with the arrays
``input/<name>``, ``local/<name>`` and ``cloud/<name>``; the headers say what else is known about it:

| header | |
|---|---|
| ``Kiln-Capture-Id`` | the client's sample id (required; a repeated id is acknowledged and not stored again) |
| ``Kiln-Capture-Reason`` | why the edge forwarded the request (percent-encoded UTF-8) |
| ``Kiln-Capture-Source`` | where the edge's answer came from |
| ``Kiln-Edge-Id`` | which edge sent it |

The answer is ``{"id": ..., "stored": true|false}`` (false for a repeated id). The endpoint is off unless the server
was started with ``--capture-dir`` (403 otherwise); with an API key set it answers 401 to a request without
``Authorization: Bearer <key>``. ``version`` is the edge's model version; the model must be served here.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response

from kiln.errors import InvalidArgumentError, PermissionDeniedError
from kiln.frontends.http.auth import require_key
from kiln.server.capture import REPLICA_STORE_PREFIX, CaptureStore, Sample
from kiln.server.server import Server
from kiln.v2 import http_codec as codec

ID_HEADER = "Kiln-Capture-Id"
REASON_HEADER = "Kiln-Capture-Reason"
SOURCE_HEADER = "Kiln-Capture-Source"
EDGE_HEADER = "Kiln-Edge-Id"
DISABLED = "sample capture is disabled on this server: start it with 'kiln serve --capture-dir DIR'"


@dataclass(frozen=True)
class CaptureOptions:
    """``store``: where samples go (None: capture is off); ``api_key``: the bearer token required (None: none)."""

    store: CaptureStore | None = None
    api_key: str | None = None


def replica_capture(capture_dir: Path, replica: str, max_bytes: int, api_key: str | None = None) -> CaptureOptions:
    """Capture for one replica of a cluster: a store of its own below the folder the replicas share (a store
    numbers its samples and appends to one index, so two replicas must not write into one); `kiln capture export`
    merges the stores."""
    return CaptureOptions(CaptureStore(capture_dir / f"{REPLICA_STORE_PREFIX}{replica}", max_bytes), api_key)


class CaptureEndpoints:
    def __init__(self, server: Server, options: CaptureOptions, max_input_size: int) -> None:
        self.server = server
        self.options = options
        self.max_input_size = max_input_size

    async def capture(self, request: Request) -> Response:
        store = self.options.store
        if store is None:
            raise PermissionDeniedError(DISABLED)
        require_key(request.headers, self.options.api_key, "sample capture")
        name, version = request.path_params["model"], request.path_params["version"]
        self.server.model_metadata(name)  # NotFound for a model this server does not serve
        sample_id = request.headers.get(ID_HEADER)
        if sample_id is None:
            raise InvalidArgumentError(f"capture for model '{name}': the request lacks the {ID_HEADER} header")
        body = await request.body()
        if len(body) > self.max_input_size:
            raise InvalidArgumentError(f"capture for model '{name}': the body has {len(body)} bytes, more than "
                                       f"the limit of {self.max_input_size} (--http-max-input-size)")
        sample = Sample(sample_id, urllib.parse.unquote(request.headers.get(REASON_HEADER, "")),
                        request.headers.get(SOURCE_HEADER, ""), request.headers.get(EDGE_HEADER, ""))
        stored = await asyncio.to_thread(store.add, name, version, sample, body)
        return Response(codec.encode_json({"id": sample_id, "stored": stored}), media_type=codec.JSON_TYPE)
