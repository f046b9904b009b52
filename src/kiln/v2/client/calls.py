"""The KServe V2 / Triton HTTP API as calls: each names its method, path and body and how to read the answer, so
the sync and the async client send the same calls and differ only in how they wait."""

from __future__ import annotations

import base64
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy.typing as npt

from kiln.errors import InvalidArgumentError, KilnError
from kiln.tensor import DataType
from kiln.v2 import http_codec
from kiln.v2.http_body import parse_json
from kiln.v2.status import error_from_http
from kiln.v2.types import InferResponse

T = TypeVar("T")


@dataclass(frozen=True)
class Response:
    """One HTTP answer: status, headers (names in lower case), body, and when the request was fully written and
    when the answer's head arrived (monotonic ns; the split perf_analyzer reports as send / wait / receive)."""

    status: int
    headers: Mapping[str, str]
    body: bytes
    sent_ns: int = 0
    head_ns: int = 0

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def error(self) -> KilnError:
        """The typed error an error answer stands for, with the server's message."""
        return error_from_http(self.status, f"answered {self.status}: {error_text(self.body)}")

    def checked(self) -> Response:
        if not self.ok:
            raise self.error()
        return self

    def json(self) -> Any:
        """The body as JSON, after checking the status (an empty body is None)."""
        body = self.checked().body
        return parse_json(body, "response body") if body.strip() else None


@dataclass(frozen=True)
class Call(Generic[T]):
    method: str
    path: str
    parse: Callable[[Response], T]
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)


def error_text(body: bytes) -> str:
    """The ``{"error": ...}`` message of an error body, else its first 200 characters."""
    try:
        doc = parse_json(body, "error body")
    except InvalidArgumentError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return str(doc["error"])
    return body[:200].decode("utf-8", "replace")


def model_path(model: str, version: str = "") -> str:
    path = "/v2/models/" + urllib.parse.quote(model, safe="")
    return path + (f"/versions/{urllib.parse.quote(version, safe='')}" if version else "")


def _is_ok(response: Response) -> bool:
    return response.ok


def _json(response: Response) -> Any:
    return response.json()


def _json_body(doc: object) -> tuple[bytes, dict[str, str]]:
    return http_codec.encode_json(doc), {"Content-Type": http_codec.JSON_TYPE}


def get(path: str) -> Call[Any]:
    return Call("GET", path, _json)


def post(path: str, doc: object = None) -> Call[Any]:
    if doc is None:
        return Call("POST", path, _json)
    body, headers = _json_body(doc)
    return Call("POST", path, _json, body, headers)


def live() -> Call[bool]:
    return Call("GET", "/v2/health/live", _is_ok)


def ready() -> Call[bool]:
    return Call("GET", "/v2/health/ready", _is_ok)


def model_ready(model: str, version: str = "") -> Call[bool]:
    return Call("GET", model_path(model, version) + "/ready", _is_ok)


def server_metadata() -> Call[Any]:
    return get("/v2")


def model_metadata(model: str, version: str = "") -> Call[Any]:
    return get(model_path(model, version))


def model_config(model: str, version: str = "") -> Call[Any]:
    return get(model_path(model, version) + "/config")


def statistics(model: str = "", version: str = "") -> Call[Any]:
    return get((model_path(model, version) if model else "/v2/models") + "/stats")


def repository_index(ready_only: bool = False) -> Call[Any]:
    return post("/v2/repository/index", {"ready": True} if ready_only else None)


def load_model(model: str, config: str | None = None, files: Mapping[str, bytes] | None = None) -> Call[Any]:
    parameters: dict[str, object] = {} if config is None else {"config": config}
    parameters.update({key: base64.b64encode(data).decode() for key, data in (files or {}).items()})
    quoted = urllib.parse.quote(model, safe="")
    return post(f"/v2/repository/models/{quoted}/load", {"parameters": parameters} if parameters else None)


def unload_model(model: str, unload_dependents: bool = False) -> Call[Any]:
    quoted = urllib.parse.quote(model, safe="")
    doc = {"parameters": {"unload_dependents": True}} if unload_dependents else None
    return post(f"/v2/repository/models/{quoted}/unload", doc)


def infer(model: str, inputs: Mapping[str, npt.NDArray[Any]], *, version: str = "", outputs: Sequence[str] = (),
          binary: bool = True, datatypes: Mapping[str, DataType] | None = None,
          parameters: Mapping[str, Any] | None = None, request_id: str = "") -> Call[InferResponse]:
    """An infer call; ``binary`` sends and asks for tensors with the binary data extension, else as JSON."""
    body, headers = http_codec.encode_request(inputs, datatypes=datatypes, binary_input=binary,
                                              binary_output=binary, outputs=outputs, parameters=parameters,
                                              request_id=request_id)
    return Call("POST", model_path(model, version) + "/infer", decode_infer, body, headers)


def decode_infer(response: Response) -> InferResponse:
    length = response.checked().headers.get(http_codec.HEADER_LENGTH)
    return http_codec.decode_response(response.body, http_codec.header_length(length, len(response.body)))
