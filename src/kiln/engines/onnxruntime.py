"""ONNX Runtime engine: the embedded default backend (CPU execution provider unless a GPU instance asks)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from kiln.config.onnx_io import onnx_model_path
from kiln.config.spec import ModelSpec, TensorSpec
from kiln.engines.base import Array, Engine, EngineOptions
from kiln.errors import ConfigError, InternalError, InvalidArgumentError, UnavailableError
from kiln.tensor import DataType

# Triton's onnxruntime backend reads these config parameters; kiln honours the same keys.
_INTRA_OP = "intra_op_thread_count"
_INTER_OP = "inter_op_thread_count"

_GRAPH_LEVELS = {
    -1: ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    0: ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    1: ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
}


class OnnxRuntimeEngine(Engine):
    thread_safe = True  # onnxruntime sessions and pure functions run concurrently
    def __init__(self, spec: ModelSpec, model_file: Path, options: EngineOptions) -> None:
        super().__init__(spec)
        path = onnx_model_path(model_file)
        if not path.is_file():
            raise ConfigError(f"model '{spec.name}': model file {path} does not exist")
        self._session: ort.InferenceSession | None = _open_session(spec, path, options)
        self._reshaped_inputs = {t.name: t for t in spec.inputs if t.reshape is not None}
        self._outputs = {t.name: t for t in spec.outputs}

    @property
    def providers(self) -> list[str]:
        return list(self._require_session().get_providers())

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        session = self._require_session()
        feed = {name: self._to_model(name, array) for name, array in inputs.items()}
        try:
            results = session.run(list(outputs), feed)
        except Exception as exc:  # onnxruntime raises its own exception types for any run failure
            raise InternalError(f"model '{self.spec.name}': onnxruntime failed: {exc}") from exc
        return {name: self._from_model(self._outputs[name], value) 
                for name, value in zip(outputs, results, strict=True)}

    def close(self) -> None:
        self._session = None

    def _require_session(self) -> ort.InferenceSession:
        if self._session is None:
            raise UnavailableError(f"model '{self.spec.name}': the engine is closed")
        return self._session

    def _to_model(self, name: str, array: Array) -> Array:
        tensor = self._reshaped_inputs.get(name)
        if tensor is not None and tensor.reshape is not None:
            lead = (array.shape[0],) if self.spec.batching else ()
            array = array.reshape(lead + tensor.reshape)
        if array.dtype.kind in ("O", "S"):
            # onnxruntime's string tensors take str elements.
            try:
                texts = [_text(v) for v in array.reshape(-1)]
            except UnicodeDecodeError as exc:
                raise InvalidArgumentError(f"model '{self.spec.name}': input '{name}' holds bytes that are not "
                                           f"UTF-8 ({exc.reason} at byte {exc.start}); onnxruntime string tensors "
                                           f"need UTF-8 text") from None
            return np.array(texts, dtype=object).reshape(array.shape)
        return np.ascontiguousarray(array)

    def _from_model(self, tensor: TensorSpec, value: Any) -> Array:
        array = np.asarray(value)
        if tensor.datatype is DataType.BYTES:
            flat = [v.encode("utf-8") if isinstance(v, str) else v for v in array.reshape(-1)]
            out = np.empty(len(flat), dtype=object)
            out[:] = flat
            array = out.reshape(array.shape)
        if tensor.reshape is not None:
            lead = (array.shape[0],) if self.spec.batching else ()
            array = array.reshape(lead + tensor.dims)
        return array


def _text(value: object) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _open_session(spec: ModelSpec, path: Path, options: EngineOptions) -> ort.InferenceSession:
    session_options = ort.SessionOptions()
    intra = options.intra_op_threads or _int_parameter(spec, _INTRA_OP)
    inter = options.inter_op_threads or _int_parameter(spec, _INTER_OP)
    if intra:
        session_options.intra_op_num_threads = intra
    if inter:
        session_options.inter_op_num_threads = inter
    level = spec.config.optimization.graph.level if spec.config.optimization.HasField("graph") else 0
    session_options.graph_optimization_level = _GRAPH_LEVELS.get(level, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    providers = _providers(spec, options)
    try:
        return ort.InferenceSession(str(path), sess_options=session_options, providers=providers)
    except Exception as exc:  # invalid model, unsupported operator, missing external data ...
        raise ConfigError(f"model '{spec.name}': onnxruntime cannot load {path}: {exc}") from None


def _int_parameter(spec: ModelSpec, key: str) -> int | None:
    raw = spec.parameters.get(key)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgumentError(f"model '{spec.name}': parameter '{key}' is '{raw}'; expected an integer") from None
    return value if value > 0 else None


def _providers(spec: ModelSpec, options: EngineOptions) -> list[Any]:
    if options.kind != "gpu":
        return ["CPUExecutionProvider"]
    available = set(ort.get_available_providers())
    if "CUDAExecutionProvider" not in available:
        raise UnavailableError(
            f"model '{spec.name}': a GPU instance was requested, but this onnxruntime has no CUDA execution "
            f"provider (available: {', '.join(sorted(available))}); install onnxruntime-gpu or use KIND_CPU"
        )
    device = {"device_id": str(options.device_id)}
    providers: list[Any] = []
    accelerators = spec.config.optimization.execution_accelerators.gpu_execution_accelerator
    if any(a.name == "tensorrt" for a in accelerators) and "TensorrtExecutionProvider" in available:
        providers.append(("TensorrtExecutionProvider", device))
    providers.append(("CUDAExecutionProvider", device))
    providers.append("CPUExecutionProvider")
    return providers
