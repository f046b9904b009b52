"""Triton-style JSON rendering of a ModelConfig (what GET /v2/models/{m}/config answers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.config import config_to_json, open_model_dir
from kiln.config.parse import parse_config_text
from kiln.testing import onnx_add_sub_model, write_model
from kiln.v2._generated import model_config_pb2 as pb

FULL = """
name: "m"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1, 3 ] reshape: { shape: [ 3, -1 ] } } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ 10 ] reshape: { shape: [ 2, 5 ] } } ]
version_policy: { specific: { versions: [ 1, 3 ] } }
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
  priority_levels: 3
  default_priority_level: 2
  default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 5000 max_queue_size: 16 }
  priority_queue_policy { key: 1 value: { default_timeout_microseconds: 70 allow_timeout_override: true } }
  priority_queue_policy { key: 3 value: { max_queue_size: 2 } }
}
model_warmup [ { name: "w" batch_size: 2
  inputs { key: "IN" value: { data_type: TYPE_FP32 dims: [ 4, 3 ] zero_data: true } } } ]
"""


def _render(text: str) -> dict[str, Any]:
    return config_to_json(parse_config_text(text))


def test_field_names_are_preserved_not_camel_cased() -> None:
    doc = _render(FULL)
    for key in ("max_batch_size", "version_policy", "dynamic_batching", "model_warmup", "default_model_filename",
                "instance_group", "cc_model_filenames", "metric_tags"):
        assert key in doc
    assert "maxBatchSize" not in doc
    assert "max_queue_delay_microseconds" in doc["dynamic_batching"]
    assert "data_type" in doc["input"][0]


def test_defaults_are_printed() -> None:
    doc = _render('name: "m" input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]')
    assert doc["platform"] == ""
    assert doc["backend"] == ""
    assert doc["max_batch_size"] == 0
    assert doc["default_model_filename"] == ""
    assert doc["instance_group"] == []
    assert doc["parameters"] == {}
    assert doc["input"][0]["optional"] is False
    assert doc["input"][0]["format"] == "FORMAT_NONE"
    assert doc["output"] == []
    # Message fields with presence are printed only when set, as Triton's MessageToJsonString does.
    assert "dynamic_batching" not in doc and "sequence_batching" not in doc


def test_int64_shapes_become_numbers() -> None:
    doc = _render(FULL)
    assert doc["input"][0]["dims"] == [-1, 3]
    assert doc["input"][0]["reshape"] == {"shape": [3, -1]}
    assert doc["output"][0]["dims"] == [10]
    assert doc["output"][0]["reshape"] == {"shape": [2, 5]}
    assert doc["output"][0]["data_type"] == "TYPE_STRING"
    assert doc["version_policy"] == {"specific": {"versions": [1, 3]}}
    warm = doc["model_warmup"][0]
    assert warm["batch_size"] == 2
    assert warm["inputs"]["IN"]["dims"] == [4, 3]
    assert warm["inputs"]["IN"]["zero_data"] is True


def test_dynamic_batching_durations_are_numbers_but_priority_levels_stay_strings() -> None:
    batching = _render(FULL)["dynamic_batching"]
    assert batching["preferred_batch_size"] == [4, 8]  # int32: a number already
    assert batching["max_queue_delay_microseconds"] == 100
    assert batching["default_queue_policy"] == {
        "timeout_action": "DELAY", "default_timeout_microseconds": 5000, "allow_timeout_override": False,
        "max_queue_size": 16,
    }
    assert batching["priority_queue_policy"]["1"]["default_timeout_microseconds"] == 70
    assert batching["priority_queue_policy"]["1"]["allow_timeout_override"] is True
    assert batching["priority_queue_policy"]["3"]["default_timeout_microseconds"] == 0
    assert set(batching["priority_queue_policy"]) == {"1", "3"}  # map keys are JSON strings
    # Triton leaves these uint64 fields as protobuf's JSON strings.
    assert batching["priority_levels"] == "3"
    assert batching["default_priority_level"] == "2"


def test_default_dynamic_batching_block() -> None:
    batching = _render('name: "m" max_batch_size: 4 dynamic_batching { }')["dynamic_batching"]
    assert batching["max_queue_delay_microseconds"] == 0
    assert batching["priority_levels"] == "0"
    assert batching["preserve_ordering"] is False
    assert "default_queue_policy" not in batching


def test_sequence_batching_numbers() -> None:
    oldest = _render("sequence_batching { max_sequence_idle_microseconds: 5000000 "
                     "oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 300 } }")["sequence_batching"]
    assert oldest["max_sequence_idle_microseconds"] == 5000000
    assert oldest["oldest"]["max_queue_delay_microseconds"] == 300
    assert oldest["oldest"]["max_candidate_sequences"] == 4
    direct = _render("sequence_batching { direct { max_queue_delay_microseconds: 9 minimum_slot_utilization: 0.5 } }")
    assert direct["sequence_batching"]["direct"]["max_queue_delay_microseconds"] == 9
    assert direct["sequence_batching"]["direct"]["minimum_slot_utilization"] == 0.5
    assert direct["sequence_batching"]["max_sequence_idle_microseconds"] == 0


def test_ensemble_step_model_version_is_a_number() -> None:
    doc = _render('platform: "ensemble" ensemble_scheduling { step [ '
                  '{ model_name: "a" model_version: -1 input_map { key: "x" value: "IN" } }, '
                  '{ model_name: "b" model_version: 3 } ] }')
    steps = doc["ensemble_scheduling"]["step"]
    assert [s["model_version"] for s in steps] == [-1, 3]
    assert steps[0]["input_map"] == {"x": "IN"}


def test_large_uint64_survives() -> None:
    big = 2**64 - 1
    doc = _render(f"dynamic_batching {{ max_queue_delay_microseconds: {big} priority_levels: {big} }}")
    assert doc["dynamic_batching"]["max_queue_delay_microseconds"] == big
    assert doc["dynamic_batching"]["priority_levels"] == str(big)


def test_json_dumps_and_the_proto_is_untouched() -> None:
    config = parse_config_text(FULL)
    before = config.SerializeToString()
    doc = config_to_json(config)
    text = json.dumps(doc)
    assert json.loads(text) == doc
    assert config.SerializeToString() == before


def test_rendering_a_loaded_model(tmp_path: Path) -> None:
    spec = open_model_dir(write_model(tmp_path, "simple", onnx_add_sub_model())).spec
    doc = json.loads(json.dumps(config_to_json(spec.config)))
    assert doc["name"] == "simple"
    assert doc["backend"] == "onnxruntime"
    assert doc["platform"] == "onnxruntime_onnx"
    assert doc["max_batch_size"] == 4
    assert [(t["name"], t["data_type"], t["dims"]) for t in doc["input"]] == [
        ("INPUT0", "TYPE_FP32", [4]), ("INPUT1", "TYPE_FP32", [4])
    ]
    assert doc["instance_group"][0]["name"] == "simple_0"
    assert doc["instance_group"][0]["kind"] == "KIND_CPU"
    assert doc["instance_group"][0]["count"] == 1
    assert doc["version_policy"] == {"latest": {"num_versions": 1}}
    assert doc["default_model_filename"] == "model.onnx"
    assert doc["dynamic_batching"]["max_queue_delay_microseconds"] == 0


def test_empty_config_renders() -> None:
    doc = config_to_json(pb.ModelConfig())
    assert doc["name"] == "" and doc["input"] == [] and doc["max_batch_size"] == 0
