"""A minimal custom MLServer runtime for the comparison: one onnxruntime session, one ``session.run`` per request.

Copied next to ``model-settings.json`` by ``benchmarks/mlserver_compare.py`` (MLServer resolves
``"implementation": "onnx_runtime.OnnxRuntimeModel"`` relative to that folder). It loads the same ``model.onnx``
as kiln with the same onnxruntime defaults kiln uses (CPU execution provider, graph optimizations ALL, default
thread pools) unless ``parameters.extra.intra_op_threads`` is set. Runs inside MLServer's own venv.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri

_NUMPY = {"FP32": np.float32, "FP64": np.float64, "INT32": np.int32, "INT64": np.int64}


class OnnxRuntimeModel(MLModel):
    async def load(self) -> bool:
        model_uri = await get_model_uri(self._settings)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        extra = (self._settings.parameters.extra if self._settings.parameters else None) or {}
        if extra.get("intra_op_threads"):
            options.intra_op_num_threads = int(extra["intra_op_threads"])
        self._session = ort.InferenceSession(model_uri, sess_options=options, providers=["CPUExecutionProvider"])
        self._output_names = [o.name for o in self._session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {}
        for request_input in payload.inputs:
            array = NumpyCodec.decode_input(request_input)
            feeds[request_input.name] = np.ascontiguousarray(array, dtype=_NUMPY.get(request_input.datatype))
        results = self._session.run(self._output_names, feeds)
        return InferenceResponse(
            model_name=self.name,
            model_version=self.version,
            outputs=[NumpyCodec.encode_output(name=name, payload=result)
                     for name, result in zip(self._output_names, results, strict=True)],
        )
