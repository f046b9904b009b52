"""Render a ModelConfig as JSON the way Triton answers ``GET /v2/models/{m}/config``.

Triton prints the proto with field names preserved and default-valued scalars included, then turns the 64-bit
fields that hold sizes and durations back into JSON numbers (protobuf's JSON mapping prints every 64-bit integer
as a string). The other 64-bit fields (e.g. ``priority_levels``) stay strings, exactly as Triton leaves them.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from kiln.v2._generated import model_config_pb2 as pb


def config_to_json(config: pb.ModelConfig) -> dict[str, Any]:
    doc: dict[str, Any] = json_format.MessageToDict(
        config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    for key in ("input", "output"):
        for tensor in doc.get(key, []):
            _ints(tensor, "dims")
            _ints(tensor.get("reshape", {}), "shape")
    _ints(doc.get("version_policy", {}).get("specific", {}), "versions")
    batching = doc.get("dynamic_batching")
    if batching is not None:
        _int(batching, "max_queue_delay_microseconds")
        _int(batching.get("default_queue_policy", {}), "default_timeout_microseconds")
        for policy in batching.get("priority_queue_policy", {}).values():
            _int(policy, "default_timeout_microseconds")
    sequence = doc.get("sequence_batching")
    if sequence is not None:
        _int(sequence, "max_sequence_idle_microseconds")
        for strategy in ("oldest", "direct"):
            _int(sequence.get(strategy, {}), "max_queue_delay_microseconds")
    for step in doc.get("ensemble_scheduling", {}).get("step", []):
        _int(step, "model_version")
    for warmup in doc.get("model_warmup", []):
        for warm_input in warmup.get("inputs", {}).values():
            _ints(warm_input, "dims")
    return doc


def _int(obj: dict[str, Any], key: str) -> None:
    if key in obj:
        obj[key] = int(obj[key])


def _ints(obj: dict[str, Any], key: str) -> None:
    if key in obj:
        obj[key] = [int(v) for v in obj[key]]
