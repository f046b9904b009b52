"""Triton's ``simple_string_dyna_sequence`` example as a Python-backend model (the demo repository's
simple_string_dyna_sequence/1/model.py): ``simple_dyna_sequence`` with a string correlation ID.

OUTPUT = (INPUT + START + END * CORRID) * READY, INT32 [batch, 1], where CORRID is the sequence's ID as a string
that decodes to an integer (as Triton's example sends it; an empty ID, on a padding row, counts as 0). Written
against Triton's Python-backend API only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Provided by the server running the model: Triton's Python backend, or kiln's compatible module.
import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]  # exists only inside a server


def _input(request: Any, name: str) -> Any:
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy()


class TritonPythonModel:
    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            ids = [int(value.decode() or 0) if isinstance(value, bytes) else int(value or 0)
                   for value in _input(request, "CORRID").reshape(-1)]
            corrid = np.asarray(ids, dtype=np.int64).reshape(-1, 1)
            total = _input(request, "INPUT") + _input(request, "START") + _input(request, "END") * corrid
            output = (total * _input(request, "READY")).astype(np.int32)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", output)]))
        return responses
