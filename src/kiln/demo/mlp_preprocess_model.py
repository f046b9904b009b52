"""The demo pipeline's first step (mlp_preprocess/1/model.py): raw INT32 feature counts in [0, 255] become the
FP32 features the demo ``mlp`` expects, centred and scaled. Written against Triton's Python-backend API only."""

from __future__ import annotations

from typing import Any

import numpy as np

# Provided by the server running the model: Triton's Python backend, or kiln's compatible module.
import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]  # exists only inside a server

CENTRE = 127.5
SCALE = 64.0


class TritonPythonModel:
    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            raw = pb_utils.get_input_tensor_by_name(request, "RAW").as_numpy()
            if raw.size and (raw.min() < 0 or raw.max() > 255):
                error = pb_utils.TritonError(f"input 'RAW' holds values from {raw.min()} to {raw.max()}; "
                                             f"expected counts in [0, 255]", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            features = ((raw.astype(np.float32) - CENTRE) / SCALE).astype(np.float32)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("FEATURES", features)]))
        return responses
