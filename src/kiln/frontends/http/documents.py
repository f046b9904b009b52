"""The HTTP frontend's JSON documents beyond infer bodies (those are :mod:`kiln.v2.http_codec`): statistics,
repository index and control, shared-memory registration and status."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import InvalidArgumentError
from kiln.server.cuda_shm import CudaRegionStatus
from kiln.server.registry import IndexEntry
from kiln.server.shm import RegionStatus
from kiln.server.stats import BatchStats, Duration, ModelStats, ResponseStats
from kiln.v2.http_body import parse_json
from kiln.v2.http_codec import short_json


def statistics_doc(stats: list[ModelStats]) -> dict[str, Any]:
    """The statistics extension's ``{"model_stats": [...]}`` document."""
    return {"model_stats": [_model_stats(s) for s in stats]}


def _model_stats(stats: ModelStats) -> dict[str, Any]:
    inference = {"success": stats.success, "fail": stats.fail, "queue": stats.queue,
                 "compute_input": stats.compute_input, "compute_infer": stats.compute_infer,
                 "compute_output": stats.compute_output, "cache_hit": Duration(), "cache_miss": Duration()}
    return {
        "name": stats.name,
        "version": stats.version,
        "last_inference": stats.last_inference_ms,
        "inference_count": stats.inference_count,
        "execution_count": stats.execution_count,
        "inference_stats": {key: _duration(value) for key, value in inference.items()},
        "response_stats": {key: _response_stats(stats.response_stats[key])
                           for key in sorted(stats.response_stats, key=int)},
        "batch_stats": [_batch_stats(stats.batch_stats[size]) for size in sorted(stats.batch_stats)],
        "memory_usage": [],
    }


def _batch_stats(batch: BatchStats) -> dict[str, Any]:
    return {"batch_size": batch.batch_size, "compute_input": _duration(batch.compute_input),
            "compute_infer": _duration(batch.compute_infer), "compute_output": _duration(batch.compute_output)}


def _response_stats(entry: ResponseStats) -> dict[str, Any]:
    return {"compute_infer": _duration(entry.compute_infer), "compute_output": _duration(entry.compute_output),
            "success": _duration(entry.success), "fail": _duration(entry.fail),
            "empty_response": _duration(entry.empty_response), "cancel": _duration(entry.cancel)}


def _duration(duration: Duration) -> dict[str, int]:
    return {"count": duration.count, "ns": duration.ns}


def index_doc(entries: list[IndexEntry]) -> list[dict[str, str]]:
    return [{"name": e.name, "version": e.version, "state": e.state, "reason": e.reason} for e in entries]


def index_ready_only(body: bytes) -> bool:
    """The optional ``{"ready": bool}`` body of a repository index request."""
    if not body.strip():
        return False
    doc = parse_json(body, "repository index request")
    ready = doc.get("ready", False) if isinstance(doc, dict) else None
    if not isinstance(ready, bool):
        raise InvalidArgumentError(f"repository index: the body must be a JSON object with an optional boolean "
                                   f"'ready', got {short_json(doc)}")
    return ready


@dataclass(frozen=True)
class ControlRequest:
    """A load / unload request's parameters: ``config`` (ModelConfig JSON), ``file:<version>/<name>`` contents
    (base64 on the wire), ``unload_dependents``."""

    config: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    unload_dependents: bool = False


def control_request(body: bytes, action: str, model: str) -> ControlRequest:
    """Load / unload bodies are optional JSON objects (``{"parameters": {...}}``); reject anything else."""
    if not body.strip():
        return ControlRequest()
    doc = parse_json(body, f"{action} request")
    if not isinstance(doc, dict):
        raise InvalidArgumentError(f"{action} of model '{model}': the body must be a JSON object")
    parameters = doc.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidArgumentError(f"{action} of model '{model}': 'parameters' must be a JSON object")
    config = parameters.get("config")
    if config is not None and not isinstance(config, str):
        raise InvalidArgumentError(f"{action} of model '{model}': parameter 'config' must be a string holding "
                                   f"the model configuration as JSON")
    files: dict[str, bytes] = {}
    for key, value in parameters.items():
        if key.startswith("file:"):
            files[key] = _base64(action, model, key, value)
    dependents = parameters.get("unload_dependents", False)
    if not isinstance(dependents, bool):
        raise InvalidArgumentError(f"{action} of model '{model}': parameter 'unload_dependents' must be a boolean")
    return ControlRequest(config=config, files=files, unload_dependents=dependents)


def _base64(action: str, model: str, key: str, value: object) -> bytes:
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{action} of model '{model}': parameter '{key}' must be base64 text")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgumentError(f"{action} of model '{model}': parameter '{key}' is not valid base64") from None


def shm_status_doc(regions: list[RegionStatus]) -> list[dict[str, Any]]:
    return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in regions]


def shm_register_request(body: bytes, region: str) -> tuple[str, int, int]:
    """``{"key": str, "offset": int (default 0), "byte_size": int}`` of a system shared-memory registration."""
    where = f"register of shared memory region '{region}'"
    doc = parse_json(body, where) if body.strip() else None
    if not isinstance(doc, dict):
        raise InvalidArgumentError(f"{where}: the body must be a JSON object with 'key', 'offset' and 'byte_size'")
    key, offset, size = doc.get("key"), doc.get("offset", 0), doc.get("byte_size")
    if not isinstance(key, str):
        raise InvalidArgumentError(f"{where}: field 'key' must be the shared memory key (a string), got {key!r}")
    for field_name, value in (("offset", offset), ("byte_size", size)):
        if type(value) is not int or value < 0:
            raise InvalidArgumentError(f"{where}: field '{field_name}' must be a non-negative integer, "
                                       f"got {value!r}")
    assert isinstance(offset, int) and isinstance(size, int)
    return key, offset, size


def cuda_shm_status_doc(regions: list[CudaRegionStatus]) -> list[dict[str, Any]]:
    return [{"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size} for r in regions]


def cuda_shm_register_request(body: bytes, region: str) -> tuple[bytes, int, int]:
    """``{"raw_handle": {"b64": str}, "device_id": int, "byte_size": int}`` of a CUDA shared-memory registration:
    the CUDA IPC handle's bytes, the device and the size."""
    where = f"register of CUDA shared memory region '{region}'"
    doc = parse_json(body, where) if body.strip() else None
    if not isinstance(doc, dict):
        raise InvalidArgumentError(f"{where}: the body must be a JSON object with 'raw_handle', 'device_id' and "
                                   f"'byte_size'")
    handle = doc.get("raw_handle")
    encoded = handle.get("b64") if isinstance(handle, dict) else None
    if not isinstance(encoded, str):
        raise InvalidArgumentError(f"{where}: field 'raw_handle' must be {{\"b64\": <base64 of the CUDA IPC "
                                   f"handle>}}, got {handle!r}")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgumentError(f"{where}: raw_handle.b64 is not valid base64") from None
    device_id, size = doc.get("device_id"), doc.get("byte_size")
    for field_name, value in (("device_id", device_id), ("byte_size", size)):
        if type(value) is not int or value < 0:
            raise InvalidArgumentError(f"{where}: field '{field_name}' must be a non-negative integer, "
                                       f"got {value!r}")
    assert isinstance(device_id, int) and isinstance(size, int)
    return raw, device_id, size
