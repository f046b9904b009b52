"""A kiln extension of the repository API for A/B routing, and the sticky routing key header.

``GET /v2/repository/models/{name}/kiln/routing`` answers the model's routing status (Server.routing);
``POST`` on the same path changes it at run time with a JSON body, every field optional::

    {"weights": {"1": 90, "2": 10}, "shadow": {"version": "2", "fraction": 0.1}}

``"weights": {}`` goes back to serving the newest version; ``"shadow": null`` (or a fraction of 0) stops shadow
traffic. The answer is the new status. The header ``Kiln-Routing-Key`` on an inference request becomes the model's
routing key parameter (``kiln.ab.key``, default ``routing_key``) unless the request's parameters already carry it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kiln.errors import InvalidArgumentError
from kiln.server.server import Server
from kiln.v2 import http_codec as codec
from kiln.v2.http_body import parse_json, read_body
from kiln.v2.types import InferRequest

ROUTING_KEY_HEADER = "kiln-routing-key"  # lower case, as ASGI has it


def apply_routing_key(server: Server, key: str | None, infer_request: InferRequest) -> None:
    """Copy the ``Kiln-Routing-Key`` header's value into the request's parameters (a parameter in the body wins)."""
    if key is None:
        return
    name = server.routing_key_parameter(infer_request.model_name)
    if name not in infer_request.parameters:
        infer_request.parameters = {**infer_request.parameters, name: key}


class RoutingEndpoints:
    def __init__(self, server: Server, max_input_size: int) -> None:
        self.server = server
        self.max_input_size = max_input_size

    async def status(self, request: Request) -> Response:
        return _json(self.server.routing(request.path_params["model"]))

    async def update(self, request: Request) -> Response:
        name = request.path_params["model"]
        body = await read_body(request, self.max_input_size)
        doc = parse_json(body, "routing request") if body else {}
        weights, shadow_version, shadow_fraction = routing_update(name, doc)
        return _json(self.server.set_routing(name, weights, shadow_version, shadow_fraction))


def routing_update(model: str, doc: object) -> tuple[dict[str, float] | None, str | None, float | None]:
    """Weights, shadow version and shadow fraction from a POST body; None where the body leaves them alone.
    Versions and numbers are checked by the Server; here only the JSON shape."""
    where = f"routing request for model '{model}'"
    if not isinstance(doc, dict):
        raise InvalidArgumentError(f"{where}: the body must be a JSON object with 'weights' and/or 'shadow'")
    unknown = sorted(set(doc) - {"weights", "shadow"})
    if unknown:
        raise InvalidArgumentError(f"{where}: unknown field '{unknown[0]}'; expected 'weights' and/or 'shadow'")
    weights = doc.get("weights")
    if weights is not None and not (isinstance(weights, dict)
                                    and all(_is_number(w) for w in weights.values())):
        raise InvalidArgumentError(f"{where}: field 'weights' is {_short(weights)}; expected an object of version "
                                   f"to weight, e.g. {{\"1\": 90, \"2\": 10}}")
    if "shadow" not in doc:
        return weights, None, None
    shadow = doc["shadow"]
    if shadow is None:
        return weights, None, 0.0
    if not isinstance(shadow, dict) or set(shadow) - {"version", "fraction"}:
        raise InvalidArgumentError(f"{where}: field 'shadow' is {_short(shadow)}; expected null or an object with "
                                   f"'version' and/or 'fraction', e.g. {{\"version\": \"2\", \"fraction\": 0.1}}")
    version, fraction = shadow.get("version"), shadow.get("fraction")
    if isinstance(version, bool) or (version is not None and not isinstance(version, str | int)):
        raise InvalidArgumentError(f"{where}: shadow version is {_short(version)}; expected a version number")
    if fraction is not None and not _is_number(fraction):
        raise InvalidArgumentError(f"{where}: shadow fraction is {_short(fraction)}; expected a number in [0, 1]")
    return weights, None if version is None else str(version), None if fraction is None else float(fraction)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _json(status: Any) -> Response:
    return Response(codec.encode_json(dataclasses.asdict(status)), media_type=codec.JSON_TYPE)
