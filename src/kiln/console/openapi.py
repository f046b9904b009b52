"""kiln's HTTP API as an OpenAPI 3.1 document, built from one table of operations.

Each operation names its path (Starlette's pattern, ``{path:path}`` included), method, group, summary and the
schemas of its body and answer; the document is generated from the table, and a test checks that the table and
the HTTP app's routes are the same set. Schemas describe the JSON forms; the binary tensor extension
(``Inference-Header-Content-Length``) is described in the inference operations' text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kiln import __version__

KSERVE, TRITON, KILN, CONSOLE = "KServe V2", "Triton extensions", "kiln extensions", "Console"
_MODEL = "/v2/models/{model}"
_VERSION = "/v2/models/{model}/versions/{version}"
_SYSTEM_SHM = "/v2/systemsharedmemory"
_CUDA_SHM = "/v2/cudasharedmemory"
_ROUTING = "/v2/repository/models/{model}/kiln/routing"
_FILES = "/v2/kiln/models/{model}/versions/{version}"


@dataclass(frozen=True)
class Operation:
    path: str
    method: str
    tag: str
    summary: str
    body: str | None = None  # a schema name of the components, or None for no body
    answer: str | None = None  # the schema of a 200 answer; None: an empty JSON object
    media: str = "application/json"  # of the answer
    key: bool = False  # needs the server's API key when one is set


_INFER_NOTE = (" JSON tensors, or binary ones after a JSON header whose length the Inference-Header-Content-Length "
               "header gives (Triton's binary tensor data extension).")

OPERATIONS: tuple[Operation, ...] = (
    Operation(_MODEL + "/infer", "POST", KSERVE, "Run an inference on the model's default version." + _INFER_NOTE,
              "InferRequest", "InferResponse"),
    Operation(_VERSION + "/infer", "POST", KSERVE, "Run an inference on one version." + _INFER_NOTE,
              "InferRequest", "InferResponse"),
    Operation("/v2/health/live", "GET", KSERVE, "200 while the server is live.", answer="Empty"),
    Operation("/v2/health/ready", "GET", KSERVE, "200 while the server is ready for inference.", answer="Empty"),
    Operation("/v2", "GET", KSERVE, "Server name, version and extensions.", answer="ServerMetadata"),
    Operation(_MODEL, "GET", KSERVE, "Model metadata: versions, inputs, outputs.", answer="ModelMetadata"),
    Operation(_VERSION, "GET", KSERVE, "Metadata of one version.", answer="ModelMetadata"),
    Operation(_MODEL + "/ready", "GET", KSERVE, "200 while the model is ready.", answer="Empty"),
    Operation(_VERSION + "/ready", "GET", KSERVE, "200 while the version is ready.", answer="Empty"),
    Operation(_MODEL + "/config", "GET", TRITON, "The model configuration as JSON (model configuration extension).",
              answer="Object"),
    Operation(_VERSION + "/config", "GET", TRITON, "The configuration of one version.", answer="Object"),
    Operation("/v2/models/stats", "GET", TRITON, "Statistics of every model (statistics extension).",
              answer="Statistics"),
    Operation(_MODEL + "/stats", "GET", TRITON, "Statistics of one model's versions.", answer="Statistics"),
    Operation(_VERSION + "/stats", "GET", TRITON, "Statistics of one version.", answer="Statistics"),
    Operation("/v2/repository/index", "POST", TRITON, "Every model of the repository with each version's state "
              "and reason (model repository extension).", "IndexRequest", "RepositoryIndex"),
    Operation("/v2/repository/{repository}/index", "POST", TRITON, "The index, naming the repository.",
              "IndexRequest", "RepositoryIndex"),
    Operation("/v2/repository/models/{model}/load", "POST", TRITON, "Load or reload a model (explicit model "
              "control mode); the body may carry a config and files.", "LoadRequest", "Empty"),
    Operation("/v2/repository/models/{model}/unload", "POST", TRITON, "Unload a model (explicit model control "
              "mode).", "UnloadRequest", "Empty"),
    Operation(_SYSTEM_SHM + "/status", "GET", TRITON, "Registered system shared-memory regions.",
              answer="RegionList"),
    Operation(_SYSTEM_SHM + "/region/{region}/status", "GET", TRITON, "One system shared-memory region.",
              answer="RegionList"),
    Operation(_SYSTEM_SHM + "/region/{region}/register", "POST", TRITON, "Register a system shared-memory region.",
              "SystemRegion", "Empty"),
    Operation(_SYSTEM_SHM + "/unregister", "POST", TRITON, "Unregister every system shared-memory region.",
              answer="Empty"),
    Operation(_SYSTEM_SHM + "/region/{region}/unregister", "POST", TRITON, "Unregister one system region.",
              answer="Empty"),
    Operation(_CUDA_SHM + "/status", "GET", TRITON, "Registered CUDA shared-memory regions.", answer="RegionList"),
    Operation(_CUDA_SHM + "/region/{region}/status", "GET", TRITON, "One CUDA shared-memory region.",
              answer="RegionList"),
    Operation(_CUDA_SHM + "/region/{region}/register", "POST", TRITON, "Register a CUDA shared-memory region "
              "(an IPC handle, base64).", "CudaRegion", "Empty"),
    Operation(_CUDA_SHM + "/unregister", "POST", TRITON, "Unregister every CUDA shared-memory region.",
              answer="Empty"),
    Operation(_CUDA_SHM + "/region/{region}/unregister", "POST", TRITON, "Unregister one CUDA region.",
              answer="Empty"),
    Operation(_MODEL + "/generate", "POST", TRITON, "One answer of a model from flat JSON fields (generate "
              "extension).", "Object", "Object"),
    Operation(_VERSION + "/generate", "POST", TRITON, "The generate extension on one version.", "Object", "Object"),
    Operation(_MODEL + "/generate_stream", "POST", TRITON, "Every answer of a decoupled model as server-sent "
              "events.", "Object", "Object", media="text/event-stream"),
    Operation(_VERSION + "/generate_stream", "POST", TRITON, "The generate stream on one version.", "Object",
              "Object", media="text/event-stream"),
    Operation(_ROUTING, "GET", KILN, "A model's A/B routing: weights, per-version counts and latencies, shadow "
              "traffic and its agreement (docs/ab-testing.md).", answer="RoutingStatus"),
    Operation(_ROUTING, "POST", KILN, "Change a model's A/B weights or shadow traffic now, without a reload.",
              "RoutingUpdate", "RoutingStatus"),
    Operation(_FILES + "/files", "GET", KILN, "The files of a served version with sizes and SHA-256 (needs "
              "--allow-model-download).", answer="FileList", key=True),
    Operation(_FILES + "/files/{path:path}", "GET", KILN, "One file of a served version.", answer="Binary",
              media="application/octet-stream", key=True),
    Operation(_FILES + "/capture", "POST", KILN, "Store a sample an edge captured (an npz body; needs "
              "--capture-dir).", "Binary", "Object", key=True),
    Operation("/v2/openapi.json", "GET", KILN, "This document.", answer="Object"),
    Operation("/v2/kiln/console/status", "GET", CONSOLE, "Everything the console shows in one snapshot.",
              answer="ConsoleStatus"),
    Operation("/console", "GET", CONSOLE, "The console page.", answer="Html", media="text/html"),
    Operation("/console/api", "GET", CONSOLE, "This document as a readable page.", answer="Html",
              media="text/html"),
    Operation("/console/static/{name}", "GET", CONSOLE, "The console's files (HTML, CSS, JavaScript).",
              answer="Binary", media="application/octet-stream"),
    Operation("/console/report/{name}", "GET", CONSOLE, "A file of the `kiln bench compare` report given with "
              "--console-report.", answer="Binary", media="application/octet-stream"),
)


def _obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    return schema


_STR, _INT, _NUM, _BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
_ANY_OBJ = {"type": "object", "additionalProperties": True}
_SHAPE = {"type": "array", "items": _INT}
_TENSOR_META = _obj({"name": _STR, "datatype": _STR, "shape": _SHAPE})
_PARAMS = {"type": "object", "additionalProperties": {"type": ["string", "number", "boolean"]}}
_REF = "#/components/schemas/"

SCHEMAS: dict[str, dict[str, Any]] = {
    "Empty": {"type": "object"},
    "Object": _ANY_OBJ,
    "Binary": {"type": "string", "contentMediaType": "application/octet-stream"},
    "Html": {"type": "string", "contentMediaType": "text/html"},
    "Error": _obj({"error": _STR}, ("error",)),
    "ServerMetadata": _obj({"name": _STR, "version": _STR, "extensions": {"type": "array", "items": _STR}}),
    "ModelMetadata": _obj({"name": _STR, "versions": {"type": "array", "items": _STR}, "platform": _STR,
                           "inputs": {"type": "array", "items": _TENSOR_META},
                           "outputs": {"type": "array", "items": _TENSOR_META}}),
    "InferRequest": _obj({"id": _STR, "parameters": _PARAMS,
                          "inputs": {"type": "array", "items": _obj(
                              {"name": _STR, "datatype": _STR, "shape": _SHAPE, "parameters": _PARAMS,
                               "data": {"type": "array"}}, ("name", "datatype", "shape"))},
                          "outputs": {"type": "array", "items": _obj({"name": _STR, "parameters": _PARAMS})}},
                         ("inputs",)),
    "InferResponse": _obj({"model_name": _STR, "model_version": _STR, "id": _STR, "parameters": _PARAMS,
                           "outputs": {"type": "array", "items": _obj(
                               {"name": _STR, "datatype": _STR, "shape": _SHAPE, "parameters": _PARAMS,
                                "data": {"type": "array"}})}}),
    "Statistics": _obj({"model_stats": {"type": "array", "items": _ANY_OBJ}}),
    "IndexRequest": _obj({"ready": _BOOL}),
    "RepositoryIndex": {"type": "array", "items": _obj({"name": _STR, "version": _STR, "state": _STR,
                                                        "reason": _STR})},
    "LoadRequest": _obj({"parameters": _obj({"config": {"type": "string", "description": "config as JSON"}},
                                            ())}),
    "UnloadRequest": _obj({"parameters": _obj({"unload_dependents": _BOOL})}),
    "RegionList": {"type": "array", "items": _ANY_OBJ},
    "SystemRegion": _obj({"key": _STR, "offset": _INT, "byte_size": _INT}, ("key", "byte_size")),
    "CudaRegion": _obj({"raw_handle": _obj({"b64": _STR}), "device_id": _INT, "byte_size": _INT},
                       ("raw_handle", "device_id", "byte_size")),
    "RoutingUpdate": _obj({"weights": {"type": "object", "additionalProperties": _NUM},
                           "shadow": {"type": ["object", "null"],
                                      "properties": {"version": _STR, "fraction": _NUM}}}),
    "RoutingStatus": _obj({"model": _STR, "source": {"enum": ["config", "runtime", "none"]}, "key_parameter": _STR,
                           "weights": {"type": "object", "additionalProperties": _NUM},
                           "versions": {"type": "array", "items": _ANY_OBJ},
                           "shadow": {"type": ["object", "null"]}}),
    "FileList": {"type": "array", "items": _obj({"path": _STR, "size": _INT, "sha256": _STR})},
    "ConsoleStatus": _obj({"time_ms": _INT, "server": {"$ref": _REF + "ServerMetadata"}, "ready": _BOOL,
                           "inflight": _INT, "models": {"type": "array", "items": _ANY_OBJ},
                           "gpus": {"type": ["array", "null"]}, "captures": {"type": ["array", "null"]},
                           "report": {"type": ["object", "null"]}, "controls": _ANY_OBJ}),
}


def openapi_path(starlette_path: str) -> str:
    """``{path:path}`` (Starlette's converter syntax) as OpenAPI writes a parameter: ``{path}``."""
    return re.sub(r"\{(\w+):\w+\}", r"{\1}", starlette_path)


def openapi_document() -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(openapi_path(op.path), {})[op.method.lower()] = _operation(op)
    return {
        "openapi": "3.1.0",
        "info": {"title": "kiln HTTP API", "version": __version__,
                 "description": "KServe V2 inference protocol, the Triton extensions kiln serves, and kiln's own "
                                "extensions. Errors answer {\"error\": message} with the status of their kind."},
        "tags": [{"name": t} for t in (KSERVE, TRITON, KILN, CONSOLE)],
        "paths": paths,
        "components": {"schemas": SCHEMAS, "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}}},
    }


def _operation(op: Operation) -> dict[str, Any]:
    doc: dict[str, Any] = {"tags": [op.tag], "summary": op.summary, "operationId": _operation_id(op),
                           "parameters": [{"name": name, "in": "path", "required": True, "schema": _STR}
                                          for name in re.findall(r"\{(\w+)", op.path)],
                           "responses": {"200": _content(op.media, op.answer or "Empty", "success"),
                                         "default": _content("application/json", "Error", "error")}}
    if op.body is not None:
        media = "application/octet-stream" if op.body == "Binary" else "application/json"
        doc["requestBody"] = {"required": op.body not in ("IndexRequest", "LoadRequest", "UnloadRequest"),
                              "content": {media: {"schema": {"$ref": _REF + op.body}}}}
    if op.key:
        doc["security"] = [{"apiKey": []}]
    return doc


def _content(media: str, schema: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {media: {"schema": {"$ref": _REF + schema}}}}


def _operation_id(op: Operation) -> str:
    words = re.sub(r"\{(\w+)(:\w+)?\}", r"by_\1", op.path).strip("/").replace("/", "_").replace("-", "_")
    return f"{op.method.lower()}_{words or 'root'}"
