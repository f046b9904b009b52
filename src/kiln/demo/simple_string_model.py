"""Triton's ``simple_string`` example as a Python-backend model (the demo repository's simple_string/1/model.py).

INPUT0 and INPUT1 hold integers written as strings; OUTPUT0 is their sum and OUTPUT1 their difference, as
strings. Written against Triton's Python-backend API only, so the same file runs on Triton and on kiln.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

# Provided by the server running the model: Triton's Python backend, or kiln's compatible module.
import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]  # exists only inside a server


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        self.output_dtypes = {
            name: pb_utils.triton_string_to_numpy(pb_utils.get_output_config_by_name(config, name)["data_type"])
            for name in ("OUTPUT0", "OUTPUT1")
        }

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                a = _integers(pb_utils.get_input_tensor_by_name(request, "INPUT0"))
                b = _integers(pb_utils.get_input_tensor_by_name(request, "INPUT1"))
            except ValueError as exc:
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            outputs = [
                pb_utils.Tensor("OUTPUT0", _strings(a + b, self.output_dtypes["OUTPUT0"])),
                pb_utils.Tensor("OUTPUT1", _strings(a - b, self.output_dtypes["OUTPUT1"])),
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses


def _integers(tensor: Any) -> np.ndarray[Any, Any]:
    values = tensor.as_numpy()
    flat = []
    for value in values.reshape(-1):
        try:
            flat.append(int(value))
        except ValueError:
            raise ValueError(f"input '{tensor.name()}' holds {value!r}, which is not an integer") from None
    shape: tuple[int, ...] = values.shape
    return np.array(flat, dtype=object).reshape(shape)


def _strings(values: np.ndarray[Any, Any], dtype: Any) -> np.ndarray[Any, Any]:
    shape: tuple[int, ...] = values.shape
    return np.array([str(v).encode() for v in values.reshape(-1)], dtype=dtype).reshape(shape)
