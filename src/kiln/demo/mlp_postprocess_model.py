"""The demo pipeline's last step (mlp_postprocess/1/model.py): the demo ``mlp``'s logits become class
probabilities (softmax) and the most likely class. Written against Triton's Python-backend API only."""

from __future__ import annotations

from typing import Any

import numpy as np

# Provided by the server running the model: Triton's Python backend, or kiln's compatible module.
import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]  # exists only inside a server


class TritonPythonModel:
    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            logits = pb_utils.get_input_tensor_by_name(request, "LOGITS").as_numpy()
            shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
            probs = (shifted / shifted.sum(axis=-1, keepdims=True)).astype(np.float32)
            label = probs.argmax(axis=-1).astype(np.int32)[..., np.newaxis]
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("PROBS", probs), pb_utils.Tensor("CLASS", label)]))
        return responses
