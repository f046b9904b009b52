"""Stateful demo models for sequence batching: Triton's ``simple_sequence`` and ``simple_dyna_sequence`` examples.

Both compute what Triton's example clients (simple_*_sequence_*_client.py) check, which is not a running sum:
Triton's batching sequence test models return ``INPUT + START`` on a row that holds a request and 0 on a padding
row, and the dyna variant also adds the correlation ID on the sequence's last request. The server fills the
control inputs (START, END, READY, CORRID); clients send only INPUT.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from kiln.demo.models import batched_tensor, make_demo_model


def _control(name: str, kind: str, values: str) -> str:
    return f'    {{ name: "{name}" control [ {{ kind: {kind} {values} }} ] }}'


_START = _control("START", "CONTROL_SEQUENCE_START", "int32_false_true: [ 0, 1 ]")
_END = _control("END", "CONTROL_SEQUENCE_END", "int32_false_true: [ 0, 1 ]")
_READY = _control("READY", "CONTROL_SEQUENCE_READY", "int32_false_true: [ 0, 1 ]")
_CORRID = _control("CORRID", "CONTROL_SEQUENCE_CORRID", "data_type: TYPE_UINT64")
_CPU_INSTANCES = "instance_group [ {{ kind: KIND_CPU count: {count} }} ]\n"

SEQUENCE_CONTROLS = frozenset({"START", "READY"})
SEQUENCE_CONFIG = ("sequence_batching {\n  control_input [\n" + ",\n".join([_START, _READY]) + "\n  ]\n}\n"
                   + _CPU_INSTANCES.format(count=1))
"""The config blocks of ``simple_sequence`` after its tensors: Triton's (direct strategy, START and READY)."""

DYNA_SEQUENCE_CONTROLS = frozenset({"START", "END", "READY", "CORRID"})
DYNA_SEQUENCE_CONFIG = (
    "sequence_batching {\n  max_sequence_idle_microseconds: 10000000\n"
    "  oldest { max_candidate_sequences: 1024 max_queue_delay_microseconds: 10000 }\n"
    "  control_input [\n" + ",\n".join([_START, _END, _READY, _CORRID]) + "\n  ]\n}\n"
    + _CPU_INSTANCES.format(count=2)
)
"""The config blocks of ``simple_dyna_sequence``: Triton's (oldest strategy, all four controls, two instances)."""


def _int32(name: str) -> onnx.ValueInfoProto:
    return batched_tensor(name, TensorProto.INT32, 1)


def build_simple_sequence() -> onnx.ModelProto:
    """OUTPUT = (INPUT + START) * READY, all INT32 [batch, 1]."""
    nodes = [
        helper.make_node("Add", ["INPUT", "START"], ["started"], name="add_start"),
        helper.make_node("Mul", ["started", "READY"], ["OUTPUT"], name="zero_padding_rows"),
    ]
    inputs = [_int32("INPUT"), _int32("START"), _int32("READY")]
    return make_demo_model(helper.make_graph(nodes, "simple_sequence", inputs, [_int32("OUTPUT")]))


def build_simple_dyna_sequence() -> onnx.ModelProto:
    """OUTPUT = (INPUT + START + END * CORRID) * READY; CORRID is UINT64, taken modulo 2^32 as INT32."""
    nodes = [
        helper.make_node("Cast", ["CORRID"], ["corrid"], name="corrid_as_int32", to=TensorProto.INT32),
        helper.make_node("Mul", ["END", "corrid"], ["ended"], name="corrid_on_end"),
        helper.make_node("Add", ["INPUT", "START"], ["started"], name="add_start"),
        helper.make_node("Add", ["started", "ended"], ["total"], name="add_end"),
        helper.make_node("Mul", ["total", "READY"], ["OUTPUT"], name="zero_padding_rows"),
    ]
    inputs = [_int32("INPUT"), _int32("START"), _int32("END"), _int32("READY"),
              batched_tensor("CORRID", TensorProto.UINT64, 1)]
    return make_demo_model(helper.make_graph(nodes, "simple_dyna_sequence", inputs, [_int32("OUTPUT")]))
