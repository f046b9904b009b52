"""Triton's ``simple_identity`` example as a Python-backend model (the demo repository's simple_identity/1/model.py).

OUTPUT0 is INPUT0, element for element: BYTES of any content (embedded NULs, non-UTF-8 bytes) and any shape.
Written against Triton's Python-backend API only, so the same file runs on Triton and on kiln.
"""

from __future__ import annotations

from typing import Any

# Provided by the server running the model: Triton's Python backend, or kiln's compatible module.
import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]  # exists only inside a server


class TritonPythonModel:
    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT0", data)]))
        return responses
