"""Write the demo model repository (Triton layout: ``<name>/config.pbtxt`` and ``<name>/1/model.onnx``).

``simple_string`` and ``simple_identity`` are Python-backend models (``<name>/1/model.py``): Triton's string
examples, written against Triton's Python-backend API. ``simple_int8``, ``simple_sequence`` and
``simple_dyna_sequence`` (and ``simple_string_dyna_sequence``, Python, its string-correlation-ID twin) are the
other models Triton's example clients use, and ``image_classifier`` the one its image clients can call.
``repeat_int32`` (Python) is Triton's decoupled example: any number of responses per request, over a stream.
``mlp_pipeline`` is an ensemble: ``mlp_preprocess`` (Python) -> ``mlp`` -> ``mlp_postprocess`` (Python).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import onnx
from onnx import TensorProto

from kiln._files import write_atomic
from kiln.demo import image_classifier
from kiln.demo.models import build_mlp, build_simple
from kiln.demo.resnet import build_resnet50
from kiln.demo.sequences import (
    DYNA_SEQUENCE_CONFIG,
    DYNA_SEQUENCE_CONTROLS,
    SEQUENCE_CONFIG,
    SEQUENCE_CONTROLS,
    build_simple_dyna_sequence,
    build_simple_sequence,
)

_TRITON_TYPES: dict[int, str] = {
    TensorProto.BOOL: "TYPE_BOOL",
    TensorProto.INT8: "TYPE_INT8",
    TensorProto.INT32: "TYPE_INT32",
    TensorProto.INT64: "TYPE_INT64",
    TensorProto.FLOAT16: "TYPE_FP16",
    TensorProto.FLOAT: "TYPE_FP32",
}


@dataclass(frozen=True)
class _DemoModel:
    name: str
    build: Callable[[int], onnx.ModelProto]
    max_batch_size: int
    # Triton config blocks written after the tensors, verbatim.
    extra_config: str = ""
    # Graph inputs the server fills (sequence control inputs): not listed under `input`.
    controls: frozenset[str] = frozenset()


_SIMPLE = _DemoModel("simple", lambda _seed: build_simple(), max_batch_size=8)
# The example clients' models are tiny: one intra-op thread each, which also keeps them out of the CPU thread
# budget that the server shares among the other models' instances (simple and mlp keep theirs).
_ONE_THREAD = 'parameters { key: "intra_op_thread_count" value: { string_value: "1" } }\n'
_SIMPLE_INT8 = _DemoModel("simple_int8", lambda _seed: build_simple(TensorProto.INT8, "simple_int8"), max_batch_size=8,
                          extra_config=_ONE_THREAD)
_SIMPLE_SEQUENCE = _DemoModel("simple_sequence", lambda _seed: build_simple_sequence(), max_batch_size=8,
                              extra_config=SEQUENCE_CONFIG + _ONE_THREAD, controls=SEQUENCE_CONTROLS)
_SIMPLE_DYNA_SEQUENCE = _DemoModel("simple_dyna_sequence", lambda _seed: build_simple_dyna_sequence(),
                                   max_batch_size=8, extra_config=DYNA_SEQUENCE_CONFIG + _ONE_THREAD,
                                   controls=DYNA_SEQUENCE_CONTROLS)
_TRITON_EXAMPLES = (_SIMPLE_INT8, _SIMPLE_SEQUENCE, _SIMPLE_DYNA_SEQUENCE)
_MLP = _DemoModel(
    "mlp",
    build_mlp,
    max_batch_size=32,
    extra_config="dynamic_batching { }\ninstance_group [\n  {\n    kind: KIND_CPU\n    count: 1\n  }\n]\n",
)
_RESNET50 = _DemoModel("resnet50", build_resnet50, max_batch_size=16, extra_config="dynamic_batching { }\n")

SIMPLE_STRING = "simple_string"
# Triton's simple_string example: integers as strings in, their sum and difference as strings out.
_SIMPLE_STRING_CONFIG = """name: "simple_string"
backend: "python"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_STRING dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_STRING dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_STRING dims: [ 16 ] }
]
"""

SIMPLE_IDENTITY = "simple_identity"
# Triton's simple_identity example: BYTES in, the same BYTES out, any shape.
_SIMPLE_IDENTITY_CONFIG = """name: "simple_identity"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
"""


REPEAT_INT32 = "repeat_int32"
# Triton's decoupled example: one response per element of IN, each after its DELAY; execute returns after WAIT.
_REPEAT_INT32_CONFIG = """name: "repeat_int32"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] },
  { name: "WAIT" data_type: TYPE_UINT32 dims: [ 1 ] }
]
output [
  { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] }
]
"""


SIMPLE_STRING_DYNA_SEQUENCE = "simple_string_dyna_sequence"
# Triton's example repository makes it from simple_dyna_sequence with the CORRID control as TYPE_STRING.
_SIMPLE_STRING_DYNA_SEQUENCE_CONFIG = f"""name: "{SIMPLE_STRING_DYNA_SEQUENCE}"
backend: "python"
max_batch_size: 8
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
""" + DYNA_SEQUENCE_CONFIG.replace("data_type: TYPE_UINT64", "data_type: TYPE_STRING")


def build_demo_repository(path: str | os.PathLike[str], *, include_resnet50: bool = False, seed: int = 0) -> list[str]:
    """Build the demo models under ``path`` and return the names written.

    The same seed gives byte-identical files. Files are replaced atomically, and left untouched when already
    identical, so a server polling the repository neither sees half a file nor reloads for nothing. Other
    files under ``path`` are left alone.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    for demo in (_SIMPLE, _MLP, *_TRITON_EXAMPLES):
        _write_demo(root / demo.name, demo, seed)
    _write_python_model(root / SIMPLE_STRING, "simple_string_model.py", _SIMPLE_STRING_CONFIG)
    _write_python_model(root / SIMPLE_IDENTITY, "simple_identity_model.py", _SIMPLE_IDENTITY_CONFIG)
    _write_python_model(root / SIMPLE_STRING_DYNA_SEQUENCE, "simple_string_dyna_sequence_model.py",
                        _SIMPLE_STRING_DYNA_SEQUENCE_CONFIG)
    _write_python_model(root / REPEAT_INT32, "repeat_int32_model.py", _REPEAT_INT32_CONFIG)
    _write_pipeline(root)
    _write_image_classifier(root / image_classifier.NAME, seed)
    names = [_SIMPLE.name, _MLP.name, SIMPLE_STRING, *_PIPELINE_STEPS, PIPELINE,
             *(demo.name for demo in _TRITON_EXAMPLES), SIMPLE_IDENTITY, SIMPLE_STRING_DYNA_SEQUENCE,
             REPEAT_INT32, image_classifier.NAME]
    if include_resnet50:
        _write_demo(root / _RESNET50.name, _RESNET50, seed)
        names.append(_RESNET50.name)
    return names

PIPELINE = "mlp_pipeline"
# Python-backend steps of the pipeline: folder name, packaged source, config.
_PIPELINE_STEPS = {
    "mlp_preprocess": ("mlp_preprocess_model.py", """name: "mlp_preprocess"
backend: "python"
max_batch_size: 32
input [ { name: "RAW" data_type: TYPE_INT32 dims: [ 64 ] } ]
output [ { name: "FEATURES" data_type: TYPE_FP32 dims: [ 64 ] } ]
"""),
    "mlp_postprocess": ("mlp_postprocess_model.py", """name: "mlp_postprocess"
backend: "python"
max_batch_size: 32
input [ { name: "LOGITS" data_type: TYPE_FP32 dims: [ 10 ] } ]
output [
  { name: "PROBS" data_type: TYPE_FP32 dims: [ 10 ] },
  { name: "CLASS" data_type: TYPE_INT32 dims: [ 1 ] }
]
"""),
}
# Raw INT32 counts -> preprocess -> mlp (dynamic batching) -> postprocess -> class probabilities and class.
_PIPELINE_CONFIG = """name: "mlp_pipeline"
platform: "ensemble"
max_batch_size: 32
input [ { name: "RAW" data_type: TYPE_INT32 dims: [ 64 ] } ]
output [
  { name: "PROBS" data_type: TYPE_FP32 dims: [ 10 ] },
  { name: "CLASS" data_type: TYPE_INT32 dims: [ 1 ] }
]
ensemble_scheduling {
  step [
    {
      model_name: "mlp_preprocess"
      model_version: -1
      input_map { key: "RAW" value: "RAW" }
      output_map { key: "FEATURES" value: "features" }
    },
    {
      model_name: "mlp"
      model_version: -1
      input_map { key: "INPUT0" value: "features" }
      output_map { key: "OUTPUT0" value: "logits" }
    },
    {
      model_name: "mlp_postprocess"
      model_version: -1
      input_map { key: "LOGITS" value: "logits" }
      output_map [ { key: "PROBS" value: "PROBS" }, { key: "CLASS" value: "CLASS" } ]
    }
  ]
}
"""


def _write_demo(folder: Path, demo: _DemoModel, seed: int) -> None:
    model = demo.build(seed)
    onnx.checker.check_model(model, full_check=True)
    (folder / "1").mkdir(parents=True, exist_ok=True)
    # The model first: a server that sees the config should find the model it names.
    _write_atomic(folder / "1" / "model.onnx", model.SerializeToString(deterministic=True))
    config = render_config(demo.name, model, demo.max_batch_size, demo.extra_config, demo.controls)
    _write_atomic(folder / "config.pbtxt", config)


def _write_image_classifier(folder: Path, seed: int) -> None:
    """Its config names the input's layout and a labels file, which the generic config writer does not."""
    model = image_classifier.build_image_classifier(seed)
    onnx.checker.check_model(model, full_check=True)
    (folder / "1").mkdir(parents=True, exist_ok=True)
    _write_atomic(folder / "1" / "model.onnx", model.SerializeToString(deterministic=True))
    _write_atomic(folder / "labels.txt", image_classifier.labels_file())
    _write_atomic(folder / "config.pbtxt", image_classifier.CONFIG.encode())


def _write_pipeline(root: Path) -> None:
    for name, (source, config) in _PIPELINE_STEPS.items():
        (root / name / "1").mkdir(parents=True, exist_ok=True)
        _write_atomic(root / name / "1" / "model.py", resources.files("kiln.demo").joinpath(source).read_bytes())
        _write_atomic(root / name / "config.pbtxt", config.encode())
    (root / PIPELINE / "1").mkdir(parents=True, exist_ok=True)  # an ensemble's version folder holds no file
    _write_atomic(root / PIPELINE / "config.pbtxt", _PIPELINE_CONFIG.encode())


def _write_python_model(folder: Path, source: str, config: str) -> None:
    (folder / "1").mkdir(parents=True, exist_ok=True)
    _write_atomic(folder / "1" / "model.py", resources.files("kiln.demo").joinpath(source).read_bytes())
    _write_atomic(folder / "config.pbtxt", config.encode())


def render_config(name: str, model: onnx.ModelProto, max_batch_size: int, extra_config: str = "",
                  controls: frozenset[str] = frozenset()) -> bytes:
    """Triton ``config.pbtxt`` text whose inputs and outputs are read off the ONNX graph, so they cannot drift;
    ``controls`` names graph inputs the server fills (sequence controls), which are left out of ``input``."""
    lines = [
        f'name: "{name}"',
        'platform: "onnxruntime_onnx"',
        'backend: "onnxruntime"',
        f"max_batch_size: {max_batch_size}",
    ]
    batched = max_batch_size > 0
    lines += _tensor_block("input", [i for i in model.graph.input if i.name not in controls], batched)
    lines += _tensor_block("output", model.graph.output, batched)
    return ("\n".join(lines) + "\n" + extra_config).encode()


def _tensor_block(field: str, tensors: Iterable[onnx.ValueInfoProto], batched: bool) -> list[str]:
    entries = []
    for value in tensors:
        entries.append(
            "  {\n"
            f'    name: "{value.name}"\n'
            f"    data_type: {_TRITON_TYPES[value.type.tensor_type.elem_type]}\n"
            f"    dims: [ {', '.join(str(d) for d in _dims(value, batched))} ]\n"
            "  }"
        )
    return [f"{field} [", ",\n".join(entries), "]"]


def _dims(value: onnx.ValueInfoProto, batched: bool) -> list[int]:
    # Triton leaves the batch dimension out of dims when max_batch_size > 0; -1 marks any other dynamic dim.
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim]
    return dims[1:] if batched else dims


def _write_atomic(path: Path, data: bytes) -> None:
    if path.is_file() and path.read_bytes() == data:  # identical: a polling server sees no change, no reload
        return
    write_atomic(path, data)
