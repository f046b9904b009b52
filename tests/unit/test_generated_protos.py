"""Tests for kiln's own Triton-compatible .proto files and their generated code.

* the committed generated modules match what ``tools/gen_protos.py`` produces;
* kiln's modules and the official ``tritonclient`` modules (which define the
  same ``inference.*`` names in protobuf's default pool) work in one process;
* messages are wire-compatible with tritonclient's in both directions;
* the message/enum schema and the gRPC service match tritonclient's
  descriptors exactly (names, numbers, types, labels, oneofs, streaming).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tritongrpc
from google.protobuf import descriptor, descriptor_pool, text_format
from google.protobuf.message import Message
from tritonclient.grpc import model_config_pb2 as tc_mc
from tritonclient.grpc import service_pb2 as tc_svc

from kiln._proto_pool import POOL
from kiln.v2._generated import grpc_service_pb2 as kiln_svc
from kiln.v2._generated import grpc_service_pb2_grpc as kiln_svc_grpc
from kiln.v2._generated import model_config_pb2 as kiln_mc

REPO_ROOT = Path(__file__).resolve().parents[2]
GEN_SCRIPT = REPO_ROOT / "tools" / "gen_protos.py"

SERVICE_FULL_NAME = "inference.GRPCInferenceService"

# Every RPC of Triton's GRPCInferenceService (triton.md section 4).
TRITON_RPCS = frozenset(
    {
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
        "ModelStreamInfer",
        "ModelConfig",
        "ModelStatistics",
        "RepositoryIndex",
        "RepositoryModelLoad",
        "RepositoryModelUnload",
        "SystemSharedMemoryStatus",
        "SystemSharedMemoryRegister",
        "SystemSharedMemoryUnregister",
        "CudaSharedMemoryStatus",
        "CudaSharedMemoryRegister",
        "CudaSharedMemoryUnregister",
        "TraceSetting",
        "LogSettings",
    }
)

FULL_CONFIG_PBTXT = """
name: "resnet"
platform: "onnxruntime_onnx"
backend: "onnxruntime"
runtime: "libtriton_onnxruntime.so"
version_policy: { specific: { versions: [1, 3] } }
max_batch_size: 8
input [
  {
    name: "INPUT0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [3, -1, 224]
    reshape: { shape: [3, 224, 224] }
    allow_ragged_batch: true
    optional: true
    is_non_linear_format_io: true
  }
]
output [
  {
    name: "OUTPUT0"
    data_type: TYPE_BF16
    dims: [1000]
    label_filename: "labels.txt"
    is_shape_tensor: false
    is_non_linear_format_io: true
  }
]
batch_input [
  {
    kind: BATCH_ITEM_SHAPE_FLATTEN
    target_name: ["BI"]
    data_type: TYPE_INT32
    source_input: ["INPUT0"]
  }
]
batch_output [
  { target_name: ["OUTPUT0"] kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: ["INPUT0"] }
]
optimization {
  graph { level: 1 }
  priority: PRIORITY_MAX
  cuda {
    graphs: true
    busy_wait_events: true
    output_copy_stream: true
    graph_spec [
      {
        batch_size: 4
        input { key: "INPUT0" value { dim: [3, 224, 224] } }
        graph_lower_bound { batch_size: 1 input { key: "INPUT0" value { dim: [3, 16, 224] } } }
      }
    ]
  }
  execution_accelerators {
    gpu_execution_accelerator [
      { name: "tensorrt" parameters { key: "precision_mode" value: "FP16" } }
    ]
    cpu_execution_accelerator [ { name: "openvino" } ]
  }
  input_pinned_memory { enable: false }
  output_pinned_memory { enable: true }
  gather_kernel_buffer_threshold: 3
  eager_batching: true
}
dynamic_batching {
  preferred_batch_size: [4, 8]
  max_queue_delay_microseconds: 100
  preserve_ordering: true
  priority_levels: 2
  default_priority_level: 1
  default_queue_policy {
    timeout_action: DELAY
    default_timeout_microseconds: 5000
    allow_timeout_override: true
    max_queue_size: 16
  }
  priority_queue_policy { key: 2 value { max_queue_size: 4 } }
}
instance_group [
  {
    name: "g0"
    kind: KIND_GPU
    count: 2
    gpus: [0, 1]
    profile: ["0"]
    rate_limiter {
      resources [ { name: "R1" global: true count: 2 } ]
      priority: 2
    }
    passive: true
    secondary_devices [ { kind: KIND_NVDLA device_id: 1 } ]
    host_policy: "gpu_0"
  },
  { kind: KIND_MODEL }
]
default_model_filename: "model.onnx"
cc_model_filenames { key: "7.5" value: "model_t4.onnx" }
metric_tags { key: "team" value: "vision" }
parameters { key: "threads" value { string_value: "4" } }
model_warmup [
  {
    name: "w"
    batch_size: 2
    count: 3
    inputs { key: "INPUT0" value { data_type: TYPE_FP32 dims: [3, 224, 224] random_data: true } }
  }
]
model_operations { op_library_filename: ["libcustom.so"] }
model_transaction_policy { decoupled: true }
model_repository_agents { agents [ { name: "checksum" parameters { key: "MD5" value: "x" } } ] }
response_cache { enable: true }
model_metrics {
  metric_control [
    {
      metric_identifier { family: "nv_inference_first_response_histogram_ms" }
      histogram_options { buckets: [-5.0, 0, 3.5, 100] }
    }
  ]
}
"""

SEQUENCE_CONFIG_PBTXT = """
name: "seq"
backend: "python"
max_batch_size: 4
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  iterative_sequence: true
  oldest {
    max_candidate_sequences: 4
    preferred_batch_size: [2, 4]
    max_queue_delay_microseconds: 10
    preserve_ordering: true
  }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [0, 1] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [false, true] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [0, 1] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
  state [
    {
      input_name: "INPUT_STATE"
      output_name: "OUTPUT_STATE"
      data_type: TYPE_INT32
      dims: [-1]
      initial_state [ { name: "init" data_type: TYPE_INT32 dims: [1] zero_data: true } ]
      use_same_buffer_for_input_output: true
      use_growable_memory: true
    }
  ]
}
"""

ENSEMBLE_CONFIG_PBTXT = """
name: "ens"
platform: "ensemble"
version_policy: { latest: { num_versions: 2 } }
ensemble_scheduling {
  max_inflight_requests: 8
  step [
    {
      model_name: "pre"
      model_version: -1
      model_namespace: "ns"
      input_map { key: "RAW" value: "IN" }
      output_map { key: "OUT" value: "pre_out" }
    }
  ]
}
"""


@functools.cache
def _load_gen_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kiln_tools_gen_protos", GEN_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses need the module registered
    spec.loader.exec_module(module)
    return module


def _tc_equivalent(msg: Message, tc_module: ModuleType) -> Message:
    """Parse ``msg``'s bytes with the tritonclient class of the same full name."""
    desc = msg.DESCRIPTOR
    parts = desc.full_name.removeprefix("inference.").split(".")
    cls: Any = tc_module
    for part in parts:
        cls = getattr(cls, part)
    other = cls()
    assert isinstance(other, Message)
    other.ParseFromString(msg.SerializeToString())
    return other


def _assert_same_wire(kiln_msg: Message, tc_module: ModuleType) -> None:
    """kiln -> bytes -> tritonclient -> bytes -> kiln is lossless and byte-exact."""
    tc_msg = _tc_equivalent(kiln_msg, tc_module)
    assert tc_msg.DESCRIPTOR.full_name == kiln_msg.DESCRIPTOR.full_name
    assert tc_msg.DESCRIPTOR is not kiln_msg.DESCRIPTOR
    # Identical deterministic encodings => identical field numbers and types.
    assert tc_msg.SerializeToString(deterministic=True) == kiln_msg.SerializeToString(deterministic=True)
    # Identical text => identical field names (and nothing was dropped as unknown).
    assert text_format.MessageToString(tc_msg) == text_format.MessageToString(kiln_msg)
    back = type(kiln_msg)()
    back.ParseFromString(tc_msg.SerializeToString())
    assert back == kiln_msg


# --------------------------------------------------------------------------- (a) drift


def test_generated_files_match_generator() -> None:
    gen = _load_gen_module()
    problems = gen.check()
    assert not problems, (
        "Generated protobuf files drifted from tools/gen_protos.py output; "
        "run `python tools/gen_protos.py`:\n" + "\n".join(problems)
    )


def test_generator_check_cli_exits_zero() -> None:
    result = subprocess.run(
        [sys.executable, str(GEN_SCRIPT), "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_files_carry_do_not_edit_header() -> None:
    gen = _load_gen_module()
    for spec in gen.SPECS:
        for name in spec.outputs():
            head = (REPO_ROOT / spec.out_dir / name).read_text(encoding="utf-8").splitlines()[:2]
            assert any("Generated by tools/gen_protos.py" in line for line in head), name
            assert any("DO NOT EDIT" in line for line in head), name


# ------------------------------------------------------- pools / coexistence


def test_kiln_registers_in_private_pool_only() -> None:
    default = descriptor_pool.Default()  # type: ignore[no-untyped-call]
    assert POOL is not default
    assert kiln_mc.DESCRIPTOR.pool is POOL
    assert kiln_svc.DESCRIPTOR.pool is POOL
    assert tc_mc.DESCRIPTOR.pool is default
    # Stable, checkout-independent file names (the same names Triton uses).
    assert kiln_mc.DESCRIPTOR.name == "model_config.proto"
    assert kiln_svc.DESCRIPTOR.name == "grpc_service.proto"
    assert list(kiln_svc.DESCRIPTOR.dependencies) == [kiln_mc.DESCRIPTOR]
    assert POOL.FindMessageTypeByName("inference.ModelConfig") is kiln_mc.ModelConfig.DESCRIPTOR
    # tritonclient's registrations in the default pool are untouched.
    assert default.FindMessageTypeByName("inference.ModelConfig") is tc_mc.ModelConfig.DESCRIPTOR
    assert default.FindServiceByName(SERVICE_FULL_NAME) is tc_svc.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert kiln_mc.ModelConfig is not tc_mc.ModelConfig


def test_generated_classes_have_importable_module_names() -> None:
    assert kiln_mc.ModelConfig.__module__ == "kiln.v2._generated.model_config_pb2"
    assert kiln_svc.ModelInferRequest.__module__ == "kiln.v2._generated.grpc_service_pb2"
    cfg = kiln_mc.ModelConfig(name="m", max_batch_size=2)
    clone = pickle.loads(pickle.dumps(cfg))
    assert type(clone) is kiln_mc.ModelConfig
    assert clone == cfg


# ------------------------------------------------------------- (b) interop


@pytest.mark.parametrize(
    "pbtxt",
    [FULL_CONFIG_PBTXT, SEQUENCE_CONFIG_PBTXT, ENSEMBLE_CONFIG_PBTXT],
    ids=["full", "sequence", "ensemble"],
)
def test_model_config_text_parses_and_matches_tritonclient(pbtxt: str) -> None:
    # Both kiln's and tritonclient's modules are loaded in this process.
    assert hasattr(tritongrpc, "InferenceServerClient")

    kiln_cfg = text_format.Parse(pbtxt, kiln_mc.ModelConfig())
    tc_cfg = tc_mc.ModelConfig()
    tc_cfg.ParseFromString(kiln_cfg.SerializeToString())

    # Parsing the same text with tritonclient's class gives the same message.
    tc_from_text = text_format.Parse(pbtxt, tc_mc.ModelConfig())
    assert tc_cfg == tc_from_text
    _assert_same_wire(kiln_cfg, tc_mc)


def test_model_config_fields_survive_wire_into_tritonclient() -> None:
    kiln_cfg = text_format.Parse(FULL_CONFIG_PBTXT, kiln_mc.ModelConfig())
    tc_cfg = tc_mc.ModelConfig.FromString(kiln_cfg.SerializeToString())

    assert tc_cfg.name == "resnet"
    assert tc_cfg.backend == "onnxruntime"
    assert tc_cfg.runtime == "libtriton_onnxruntime.so"
    assert tc_cfg.max_batch_size == 8
    assert tc_cfg.WhichOneof("scheduling_choice") == "dynamic_batching"
    assert tc_cfg.version_policy.WhichOneof("policy_choice") == "specific"
    assert list(tc_cfg.version_policy.specific.versions) == [1, 3]
    inp = tc_cfg.input[0]
    assert (inp.name, inp.data_type, inp.format) == (
        "INPUT0",
        tc_mc.TYPE_FP32,
        tc_mc.ModelInput.FORMAT_NCHW,
    )
    assert list(inp.dims) == [3, -1, 224]
    assert inp.optional and inp.allow_ragged_batch and inp.is_non_linear_format_io
    assert tc_cfg.output[0].data_type == tc_mc.TYPE_BF16
    assert tc_cfg.output[0].label_filename == "labels.txt"
    db = tc_cfg.dynamic_batching
    assert list(db.preferred_batch_size) == [4, 8]
    assert db.max_queue_delay_microseconds == 100
    assert db.default_queue_policy.timeout_action == tc_mc.ModelQueuePolicy.DELAY
    assert db.priority_queue_policy[2].max_queue_size == 4
    group = tc_cfg.instance_group[0]
    assert group.kind == tc_mc.ModelInstanceGroup.KIND_GPU
    assert list(group.gpus) == [0, 1]
    assert group.rate_limiter.resources[0].count == 2
    assert group.secondary_devices[0].device_id == 1
    assert tc_cfg.instance_group[1].kind == tc_mc.ModelInstanceGroup.KIND_MODEL
    assert tc_cfg.cc_model_filenames["7.5"] == "model_t4.onnx"
    assert tc_cfg.parameters["threads"].string_value == "4"
    assert tc_cfg.model_warmup[0].inputs["INPUT0"].WhichOneof("input_data_type") == "random_data"
    assert tc_cfg.model_transaction_policy.decoupled
    assert tc_cfg.response_cache.enable
    assert list(tc_cfg.model_metrics.metric_control[0].histogram_options.buckets) == [
        -5.0,
        0.0,
        3.5,
        100.0,
    ]
    assert tc_cfg.optimization.cuda.graph_spec[0].graph_lower_bound.input["INPUT0"].dim[1] == 16

    # Enum values are identical, name for name.
    for name, value in tc_mc.DataType.items():
        assert kiln_mc.DataType.Value(name) == value


def test_model_config_from_tritonclient_into_kiln() -> None:
    tc_cfg = text_format.Parse(SEQUENCE_CONFIG_PBTXT, tc_mc.ModelConfig())
    kiln_cfg = kiln_mc.ModelConfig.FromString(tc_cfg.SerializeToString())
    seq = kiln_cfg.sequence_batching
    assert kiln_cfg.WhichOneof("scheduling_choice") == "sequence_batching"
    assert seq.WhichOneof("strategy_choice") == "oldest"
    assert seq.oldest.max_candidate_sequences == 4
    assert [c.name for c in seq.control_input] == ["START", "READY", "END", "CORRID"]
    corrid = seq.control_input[3].control[0]
    assert corrid.kind == kiln_mc.ModelSequenceBatching.Control.CONTROL_SEQUENCE_CORRID
    assert corrid.data_type == kiln_mc.TYPE_UINT64
    assert list(seq.control_input[1].control[0].bool_false_true) == [False, True]
    state = seq.state[0]
    assert state.initial_state[0].WhichOneof("state_data") == "zero_data"
    assert state.use_growable_memory
    assert text_format.MessageToString(kiln_cfg) == text_format.MessageToString(tc_cfg)


# ----------------------------------------------------------------- (c) wire


def _infer_parameters(target: Any) -> None:
    target["b"].bool_param = True
    target["i"].int64_param = -(2**62)
    target["s"].string_param = "hello"
    target["d"].double_param = 2.5
    target["u"].uint64_param = 2**64 - 1


def test_model_infer_request_wire_roundtrip() -> None:
    req = kiln_svc.ModelInferRequest(model_name="m", model_version="3", id="req-1")
    _infer_parameters(req.parameters)

    raw = req.inputs.add(name="RAW", datatype="FP16", shape=[2, 2])
    raw.parameters["shared_memory_region"].string_param = "r0"
    req.raw_input_contents.append(b"\x00\x3c" * 4)

    typed = req.inputs.add(name="TYPED", datatype="FP32", shape=[1])
    c = typed.contents
    c.bool_contents.extend([True, False])
    c.int_contents.extend([-1, 2])
    c.int64_contents.extend([-(2**40)])
    c.uint_contents.extend([2**32 - 1])
    c.uint64_contents.extend([2**64 - 1])
    c.fp32_contents.extend([1.5, -0.25])
    c.fp64_contents.extend([3.25])
    c.bytes_contents.extend([b"a", b"\x00\xff"])

    out = req.outputs.add(name="OUT")
    out.parameters["classification"].int64_param = 3
    out.parameters["binary_data"].bool_param = True

    tc_req = _tc_equivalent(req, tc_svc)
    assert isinstance(tc_req, tc_svc.ModelInferRequest)
    assert list(tc_req.raw_input_contents) == [b"\x00\x3c" * 4]
    params = tc_req.parameters
    assert params["b"].WhichOneof("parameter_choice") == "bool_param" and params["b"].bool_param
    assert params["i"].int64_param == -(2**62)
    assert params["s"].string_param == "hello"
    assert params["d"].WhichOneof("parameter_choice") == "double_param"
    assert params["d"].double_param == 2.5
    assert params["u"].WhichOneof("parameter_choice") == "uint64_param"
    assert params["u"].uint64_param == 2**64 - 1
    tc_c = tc_req.inputs[1].contents
    assert list(tc_c.bool_contents) == [True, False]
    assert list(tc_c.int_contents) == [-1, 2]
    assert list(tc_c.int64_contents) == [-(2**40)]
    assert list(tc_c.uint_contents) == [2**32 - 1]
    assert list(tc_c.uint64_contents) == [2**64 - 1]
    assert list(tc_c.fp32_contents) == [1.5, -0.25]
    assert list(tc_c.fp64_contents) == [3.25]
    assert list(tc_c.bytes_contents) == [b"a", b"\x00\xff"]
    assert tc_req.inputs[0].parameters["shared_memory_region"].string_param == "r0"
    assert tc_req.outputs[0].parameters["classification"].int64_param == 3
    _assert_same_wire(req, tc_svc)


def test_model_infer_response_and_stream_wire_roundtrip() -> None:
    resp = kiln_svc.ModelInferResponse(model_name="m", model_version="1", id="req-1")
    _infer_parameters(resp.parameters)
    resp.parameters["triton_final_response"].bool_param = True
    out0 = resp.outputs.add(name="OUT0", datatype="INT32", shape=[1, 2])
    out0.parameters["binary_data_size"].int64_param = 8
    resp.raw_output_contents.append(b"\x01\x00\x00\x00\x02\x00\x00\x00")
    out1 = resp.outputs.add(name="OUT1", datatype="BYTES", shape=[1])
    out1.contents.bytes_contents.append(b"label")

    tc_resp = _tc_equivalent(resp, tc_svc)
    assert isinstance(tc_resp, tc_svc.ModelInferResponse)
    assert list(tc_resp.raw_output_contents) == [b"\x01\x00\x00\x00\x02\x00\x00\x00"]
    assert tc_resp.outputs[1].contents.bytes_contents[0] == b"label"
    assert tc_resp.parameters["u"].uint64_param == 2**64 - 1
    _assert_same_wire(resp, tc_svc)

    stream = kiln_svc.ModelStreamInferResponse(error_message="", infer_response=resp)
    _assert_same_wire(stream, tc_svc)
    _assert_same_wire(kiln_svc.ModelStreamInferResponse(error_message="boom"), tc_svc)


def _duration(count: int, ns: int) -> kiln_svc.StatisticDuration:
    return kiln_svc.StatisticDuration(count=count, ns=ns)


def test_model_statistics_response_wire_roundtrip() -> None:
    stats = kiln_svc.ModelStatistics(
        name="m",
        version="1",
        last_inference=1_700_000_000_000,
        inference_count=10,
        execution_count=4,
    )
    inf = stats.inference_stats
    for i, field in enumerate(
        [
            "success",
            "fail",
            "queue",
            "compute_input",
            "compute_infer",
            "compute_output",
            "cache_hit",
            "cache_miss",
        ],
        start=1,
    ):
        getattr(inf, field).CopyFrom(_duration(i, i * 1000))
    stats.batch_stats.add(
        batch_size=4,
        compute_input=_duration(1, 10),
        compute_infer=_duration(1, 20),
        compute_output=_duration(1, 30),
    )
    stats.memory_usage.add(type="GPU", id=0, byte_size=1 << 30)
    stats.memory_usage.add(type="CPU_PINNED", id=-1, byte_size=4096)
    rs = stats.response_stats["0"]
    rs.compute_infer.CopyFrom(_duration(1, 1))
    rs.compute_output.CopyFrom(_duration(2, 2))
    rs.success.CopyFrom(_duration(3, 3))
    rs.fail.CopyFrom(_duration(4, 4))
    rs.empty_response.CopyFrom(_duration(5, 5))
    rs.cancel.CopyFrom(_duration(6, 6))
    msg = kiln_svc.ModelStatisticsResponse(model_stats=[stats])

    tc_msg = _tc_equivalent(msg, tc_svc)
    assert isinstance(tc_msg, tc_svc.ModelStatisticsResponse)
    tc_stats = tc_msg.model_stats[0]
    assert tc_stats.inference_stats.cache_miss.ns == 8000
    assert tc_stats.batch_stats[0].compute_output.ns == 30
    assert tc_stats.memory_usage[0].byte_size == 1 << 30
    assert tc_stats.memory_usage[1].id == -1
    assert tc_stats.response_stats["0"].empty_response.count == 5
    assert tc_stats.response_stats["0"].cancel.ns == 6
    _assert_same_wire(msg, tc_svc)


def test_repository_messages_wire_roundtrip() -> None:
    index = kiln_svc.RepositoryIndexResponse()
    index.models.add(name="a", version="1", state="READY", reason="")
    index.models.add(name="b", version="2", state="UNAVAILABLE", reason="unloaded")
    tc_index = _tc_equivalent(index, tc_svc)
    assert isinstance(tc_index, tc_svc.RepositoryIndexResponse)
    assert [(m.name, m.state, m.reason) for m in tc_index.models] == [
        ("a", "READY", ""),
        ("b", "UNAVAILABLE", "unloaded"),
    ]
    _assert_same_wire(index, tc_svc)
    _assert_same_wire(kiln_svc.RepositoryIndexRequest(repository_name="r", ready=True), tc_svc)

    load = kiln_svc.RepositoryModelLoadRequest(repository_name="r", model_name="m")
    load.parameters["config"].string_param = '{"max_batch_size": 4}'
    load.parameters["file:1/model.onnx"].bytes_param = b"\x08\x07"
    load.parameters["flag"].bool_param = True
    load.parameters["n"].int64_param = 7
    _assert_same_wire(load, tc_svc)
    unload = kiln_svc.RepositoryModelUnloadRequest(model_name="m")
    unload.parameters["unload_dependents"].bool_param = True
    _assert_same_wire(unload, tc_svc)


def test_misc_messages_wire_roundtrip() -> None:
    cfg = text_format.Parse(ENSEMBLE_CONFIG_PBTXT, kiln_mc.ModelConfig())
    _assert_same_wire(kiln_svc.ModelConfigResponse(config=cfg), tc_svc)

    meta = kiln_svc.ModelMetadataResponse(name="m", versions=["1", "2"], platform="ensemble")
    meta.inputs.add(name="IN", datatype="BYTES", shape=[-1, 1])
    meta.outputs.add(name="OUT", datatype="FP32", shape=[-1, 10])
    _assert_same_wire(meta, tc_svc)
    _assert_same_wire(
        kiln_svc.ServerMetadataResponse(name="kiln", version="0", extensions=["statistics"]),
        tc_svc,
    )
    _assert_same_wire(kiln_svc.ModelReadyRequest(name="m", version="1"), tc_svc)

    shm = kiln_svc.SystemSharedMemoryStatusResponse()
    shm.regions["r"].CopyFrom(
        kiln_svc.SystemSharedMemoryStatusResponse.RegionStatus(name="r", key="/k", offset=8, byte_size=64)
    )
    _assert_same_wire(shm, tc_svc)
    _assert_same_wire(
        kiln_svc.CudaSharedMemoryRegisterRequest(name="c", raw_handle=b"\x01" * 64, device_id=1, byte_size=128),
        tc_svc,
    )
    trace = kiln_svc.TraceSettingRequest(model_name="m")
    trace.settings["trace_level"].value.extend(["TIMESTAMPS", "TENSORS"])
    _assert_same_wire(trace, tc_svc)
    log = kiln_svc.LogSettingsResponse()
    log.settings["log_info"].bool_param = True
    log.settings["log_verbose_level"].uint32_param = 2
    log.settings["log_format"].string_param = "ISO8601"
    _assert_same_wire(log, tc_svc)


# --------------------------------------------------- (d) service descriptor


def test_service_matches_tritonclient() -> None:
    kiln_service = kiln_svc.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    tc_service = tc_svc.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert kiln_service.full_name == SERVICE_FULL_NAME
    assert tc_service.full_name == SERVICE_FULL_NAME
    assert POOL.FindServiceByName(SERVICE_FULL_NAME) is kiln_service  # type: ignore[no-untyped-call]

    kiln_methods = kiln_service.methods_by_name
    tc_methods = tc_service.methods_by_name
    assert TRITON_RPCS <= set(tc_methods), "tritonclient lacks an RPC listed in triton.md"
    assert set(kiln_methods) == set(tc_methods)
    for name, tc_method in tc_methods.items():
        km = kiln_methods[name]
        assert km.input_type.full_name == tc_method.input_type.full_name, name
        assert km.output_type.full_name == tc_method.output_type.full_name, name
        assert km.client_streaming == tc_method.client_streaming, name
        assert km.server_streaming == tc_method.server_streaming, name
    stream = kiln_methods["ModelStreamInfer"]
    assert stream.client_streaming and stream.server_streaming
    assert not kiln_methods["ModelInfer"].client_streaming


def test_grpc_module_exposes_servicer_and_stub() -> None:
    for rpc in TRITON_RPCS:
        assert hasattr(kiln_svc_grpc.GRPCInferenceServiceServicer, rpc), rpc
    assert callable(kiln_svc_grpc.add_GRPCInferenceServiceServicer_to_server)
    assert callable(kiln_svc_grpc.GRPCInferenceServiceStub)


def _field_signature(field: descriptor.FieldDescriptor) -> tuple[object, ...]:
    message_type = field.message_type.full_name if field.message_type else None
    enum_type = field.enum_type.full_name if field.enum_type else None
    oneof = field.containing_oneof.name if field.containing_oneof else None
    is_map = bool(field.message_type and field.message_type.GetOptions().map_entry)
    return (
        field.number,
        field.type,
        field.is_repeated,
        message_type,
        enum_type,
        oneof,
        is_map,
        field.has_presence,
    )


def _iter_messages(
    messages: Any,
) -> Iterator[descriptor.Descriptor]:
    for msg in messages:
        yield msg
        yield from _iter_messages(msg.nested_types)


def _enum_signature(enum: descriptor.EnumDescriptor) -> dict[str, int]:
    return {v.name: v.number for v in enum.values}


@pytest.mark.parametrize(
    ("kiln_file", "tc_file"),
    [(kiln_mc.DESCRIPTOR, tc_mc.DESCRIPTOR), (kiln_svc.DESCRIPTOR, tc_svc.DESCRIPTOR)],
    ids=["model_config", "grpc_service"],
)
def test_schema_matches_tritonclient_exactly(
    kiln_file: descriptor.FileDescriptor, tc_file: descriptor.FileDescriptor
) -> None:
    """Every message, field, oneof and enum has Triton's name, number and type."""
    assert kiln_file.package == tc_file.package == "inference"
    assert kiln_file.name == tc_file.name
    assert [d.name for d in kiln_file.dependencies] == [d.name for d in tc_file.dependencies]

    kiln_msgs = {m.full_name: m for m in _iter_messages(kiln_file.message_types_by_name.values())}
    tc_msgs = {m.full_name: m for m in _iter_messages(tc_file.message_types_by_name.values())}
    assert set(kiln_msgs) == set(tc_msgs)
    for full_name, tc_msg in tc_msgs.items():
        k_msg = kiln_msgs[full_name]
        k_fields = {f.name: _field_signature(f) for f in k_msg.fields}
        t_fields = {f.name: _field_signature(f) for f in tc_msg.fields}
        assert k_fields == t_fields, full_name
        assert sorted(o.name for o in k_msg.oneofs) == sorted(o.name for o in tc_msg.oneofs)
        k_enums = {e.name: _enum_signature(e) for e in k_msg.enum_types}
        t_enums = {e.name: _enum_signature(e) for e in tc_msg.enum_types}
        assert k_enums == t_enums, full_name

    k_top = {n: _enum_signature(e) for n, e in kiln_file.enum_types_by_name.items()}
    t_top = {n: _enum_signature(e) for n, e in tc_file.enum_types_by_name.items()}
    assert k_top == t_top


# ------------------------------------------- end to end over a real channel


class _Servicer(kiln_svc_grpc.GRPCInferenceServiceServicer):
    def ServerLive(
        self, request: kiln_svc.ServerLiveRequest, context: grpc.ServicerContext
    ) -> kiln_svc.ServerLiveResponse:
        return kiln_svc.ServerLiveResponse(live=True)

    def ModelInfer(
        self, request: kiln_svc.ModelInferRequest, context: grpc.ServicerContext
    ) -> kiln_svc.ModelInferResponse:
        resp = kiln_svc.ModelInferResponse(model_name=request.model_name, id=request.id)
        for tensor, raw in zip(request.inputs, request.raw_input_contents, strict=True):
            resp.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
            resp.raw_output_contents.append(raw)
        resp.parameters["priority"].CopyFrom(request.parameters["priority"])
        resp.parameters["ratio"].CopyFrom(request.parameters["ratio"])
        return resp


def test_tritonclient_talks_to_kiln_generated_server() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    kiln_svc_grpc.add_GRPCInferenceServiceServicer_to_server(_Servicer(), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        client = tritongrpc.InferenceServerClient(url=f"127.0.0.1:{port}")
        try:
            assert client.is_server_live(client_timeout=10)
            inp = tritongrpc.InferInput("X", [2], "INT32")
            inp.set_data_from_numpy(np.array([1, 2], dtype=np.int32))
            result = client.infer(
                "echo",
                [inp],
                request_id="r1",
                priority=7,
                parameters={"ratio": 0.5},
                client_timeout=10,
            )
            response = result.get_response()
            assert response.id == "r1"
            x = result.as_numpy("X")
            assert x is not None
            assert x.tolist() == [1, 2]
            assert response.parameters["priority"].uint64_param == 7
            assert response.parameters["ratio"].double_param == 0.5
        finally:
            client.close()
    finally:
        server.stop(grace=None)


# ------------------------------------------- pure-Python protobuf backend


_PURE_PYTHON_SNIPPET = textwrap.dedent(
    """
    import sys
    from google.protobuf.internal import api_implementation
    assert api_implementation.Type() == "python", api_implementation.Type()
    if sys.argv[1] == "tritonclient-first":
        from tritonclient.grpc import service_pb2 as tc
        from kiln.v2._generated import grpc_service_pb2 as kiln
    else:
        from kiln.v2._generated import grpc_service_pb2 as kiln
        from tritonclient.grpc import service_pb2 as tc
    req = kiln.ModelInferRequest(model_name="m")
    req.parameters["u"].uint64_param = 5
    back = tc.ModelInferRequest.FromString(req.SerializeToString())
    assert back.parameters["u"].uint64_param == 5
    print("ok")
    """
)


@pytest.mark.parametrize("order", ["tritonclient-first", "kiln-first"])
def test_coexistence_with_pure_python_protobuf_backend(order: str) -> None:
    env = dict(os.environ)
    env["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = "python"
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT / "src"), env.get("PYTHONPATH", "")] if p)
    result = subprocess.run(
        [sys.executable, "-c", _PURE_PYTHON_SNIPPET, order],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "ok"
