"""config.pbtxt parsing: valid text, syntax errors with file/line/column and hints, text round trips."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from google.protobuf import text_format
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.config.parse import CONFIG_FILENAME, config_to_text, parse_config_text, read_config
from kiln.errors import ConfigError
from kiln.v2._generated import model_config_pb2 as pb

SIMPLE = """
name: "simple"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  { name: "INPUT0", data_type: TYPE_INT32, dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_STRING dims: [ -1, 2 ] reshape: { shape: [ 2, -1 ] } }
]
output [ { name: "OUTPUT0" data_type: TYPE_BF16 dims: [ 16 ] label_filename: "labels.txt" } ]
version_policy: { specific: { versions: [ 1, 3 ] } }
instance_group [ { kind: KIND_CPU, count: 2 } ]
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 100 }
parameters { key: "intra_op_thread_count" value: { string_value: "2" } }
# a comment
"""


def test_parse_valid_config() -> None:
    config = parse_config_text(SIMPLE, "models/simple/config.pbtxt")
    assert config.name == "simple"
    assert config.platform == "onnxruntime_onnx"
    assert config.max_batch_size == 8
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [
        ("INPUT0", pb.TYPE_INT32, [16]),
        ("INPUT1", pb.TYPE_STRING, [-1, 2]),
    ]
    assert list(config.input[1].reshape.shape) == [2, -1]
    assert config.output[0].data_type == pb.TYPE_BF16
    assert config.output[0].label_filename == "labels.txt"
    assert list(config.version_policy.specific.versions) == [1, 3]
    assert config.instance_group[0].kind == pb.ModelInstanceGroup.KIND_CPU
    assert config.instance_group[0].count == 2
    assert list(config.dynamic_batching.preferred_batch_size) == [4, 8]
    assert config.dynamic_batching.max_queue_delay_microseconds == 100
    assert config.parameters["intra_op_thread_count"].string_value == "2"


def test_empty_text_is_an_empty_config() -> None:
    assert parse_config_text("") == pb.ModelConfig()
    assert parse_config_text("# only a comment\n\n") == pb.ModelConfig()


def test_syntax_error_names_file_line_and_column() -> None:
    text = 'name: "m"\nmax_batch_size: 4\ninput [ { name: "x" dims: [ 1 ] }\n'  # unclosed list
    with pytest.raises(ConfigError) as info:
        parse_config_text(text, "repo/m/config.pbtxt")
    message = str(info.value)
    assert message.startswith("repo/m/config.pbtxt: syntax error at line 4, column ")


def test_bad_value_names_line_column_and_value() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config_text('name: "m"\n  max_batch_size: "four"\n', "m/config.pbtxt")
    message = str(info.value)
    assert message.startswith("m/config.pbtxt: syntax error at line 2, column 19: ")
    assert '"four"' in message


def test_default_source_is_config_pbtxt() -> None:
    with pytest.raises(ConfigError, match=r"^config\.pbtxt: syntax error at line 1, column 1: "):
        parse_config_text("bogus: 1")


def test_unknown_field_hint() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config_text('name: "m"\nmax_batch: 4\n', "m/config.pbtxt")
    message = str(info.value)
    assert message.startswith("m/config.pbtxt: syntax error at line 2, column 1: ")
    assert 'has no field named "max_batch"' in message
    assert "check the spelling against Triton's model_config.proto field names" in message


def test_unknown_nested_field_names_the_message_type() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config_text('input [ { name: "a" datatype: TYPE_FP32 } ]', "m/config.pbtxt")
    message = str(info.value)
    assert "line 1, column 21" in message
    assert '"inference.ModelInput" has no field named "datatype"' in message
    assert "model_config.proto field names" in message


def test_unknown_data_type_names_file_position_and_value() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config_text('input [ {\n  name: "a"\n  data_type: TYPE_FLOAT\n} ]', "m/config.pbtxt")
    message = str(info.value)
    assert message.startswith("m/config.pbtxt: syntax error at line 3, column 14: ")
    assert "TYPE_FLOAT" in message


def test_unknown_data_type_hint_lists_valid_names() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config_text('input [ { name: "a" data_type: TYPE_FLOAT } ]', "m/config.pbtxt")
    message = str(info.value)
    assert "valid data_type values: " in message
    for name in ("TYPE_FP32", "TYPE_STRING", "TYPE_BF16", "TYPE_BOOL"):
        assert name in message
    assert "TYPE_INVALID" not in message


def test_unknown_enum_value_hint() -> None:
    with pytest.raises(ConfigError, match="check the enum value spelling, e.g. KIND_CPU, KIND_GPU"):
        parse_config_text("instance_group [ { kind: KIND_TPU } ]", "m/config.pbtxt")


def test_read_config_missing_file_is_none(tmp_path: Path) -> None:
    assert read_config(tmp_path) is None
    (tmp_path / CONFIG_FILENAME).mkdir()  # a folder named config.pbtxt is not a config
    assert read_config(tmp_path) is None


def test_read_config_reads_the_file_and_names_it_in_errors(tmp_path: Path) -> None:
    (tmp_path / "config.pbtxt").write_text('name: "m"\nmax_batch_size: 2\n', encoding="utf-8")
    config = read_config(tmp_path)
    assert config is not None and (config.name, config.max_batch_size) == ("m", 2)
    (tmp_path / "other.pbtxt").write_text("max_batch_size: [", encoding="utf-8")
    with pytest.raises(ConfigError, match="^" + re.escape(f"{tmp_path / 'other.pbtxt'}: syntax error at line 1")):
        read_config(tmp_path, "other.pbtxt")


def test_read_config_not_utf8(tmp_path: Path) -> None:
    (tmp_path / "config.pbtxt").write_bytes(b'name: "caf\xe9"\n')
    with pytest.raises(ConfigError) as info:
        read_config(tmp_path)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'config.pbtxt'}: not UTF-8 text")
    assert "at byte 10" in message
    assert "save it as UTF-8" in message


def test_read_config_utf8_text(tmp_path: Path) -> None:
    (tmp_path / "config.pbtxt").write_text('name: "m"\nparameters { key: "note" value: { string_value: "café ✓" } }\n',
                                           encoding="utf-8")
    config = read_config(tmp_path)
    assert config is not None
    assert config.parameters["note"].string_value == "café ✓"


def test_config_to_text_round_trips() -> None:
    config = parse_config_text(SIMPLE)
    assert parse_config_text(config_to_text(config)) == config


# -- property: any ModelConfig survives text_format -> parse_config_text

_names = st.text(st.characters(codec="utf-8"), max_size=12)
_int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_uint64 = st.integers(min_value=0, max_value=2**64 - 1)
_int32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
_data_types = st.sampled_from([v for k, v in pb.DataType.items() if k != "TYPE_INVALID"])


@st.composite
def _tensor(draw: st.DrawFn, message: type[pb.ModelInput] | type[pb.ModelOutput]) -> pb.ModelInput | pb.ModelOutput:
    tensor = message(name=draw(_names), data_type=draw(_data_types), dims=draw(st.lists(_int64, max_size=5)))
    if draw(st.booleans()):
        tensor.reshape.shape.extend(draw(st.lists(_int64, max_size=4)))
    return tensor


@st.composite
def _configs(draw: st.DrawFn) -> pb.ModelConfig:
    config = pb.ModelConfig(
        name=draw(_names),
        backend=draw(st.sampled_from(["", "onnxruntime", "identity"])),
        max_batch_size=draw(_int32),
    )
    config.input.extend(draw(st.lists(_tensor(pb.ModelInput), max_size=3)))
    config.output.extend(draw(st.lists(_tensor(pb.ModelOutput), max_size=3)))
    if draw(st.booleans()):
        batching = config.dynamic_batching
        batching.SetInParent()
        batching.preferred_batch_size.extend(draw(st.lists(_int32, max_size=4)))
        batching.max_queue_delay_microseconds = draw(_uint64)
        batching.preserve_ordering = draw(st.booleans())
        batching.priority_levels = draw(_uint64)
        batching.default_priority_level = draw(_uint64)
        if draw(st.booleans()):
            policy = batching.default_queue_policy
            policy.SetInParent()
            policy.timeout_action = draw(st.sampled_from([0, 1]))
            policy.default_timeout_microseconds = draw(_uint64)
            policy.allow_timeout_override = draw(st.booleans())
            policy.max_queue_size = draw(st.integers(min_value=0, max_value=2**32 - 1))
        for level in draw(st.lists(_uint64, max_size=2)):
            batching.priority_queue_policy[level].max_queue_size = draw(st.integers(min_value=0, max_value=100))
    return config


@settings(deadline=None)
@given(_configs(), st.booleans())
def test_any_config_round_trips_through_text(config: pb.ModelConfig, as_one_line: bool) -> None:
    text = text_format.MessageToString(config, as_one_line=as_one_line)
    assert parse_config_text(text, "generated/config.pbtxt") == config
