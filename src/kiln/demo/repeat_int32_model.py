"""Triton's decoupled ``repeat_int32`` example as a Python-backend model (demo repository: repeat_int32/1/model.py).

For a request with IN (INT32 [n]), DELAY (UINT32 [n], milliseconds) and WAIT (UINT32 [1], milliseconds) the model
sends n responses: the i-th after waiting DELAY[i] ms, with OUT = [IN[i]] and IDX = [i]; then the final flag alone.
A thread of the model sends them, so ``execute`` returns after WAIT ms, possibly before the last response: one
instance then serves several requests at once and their responses interleave. IN of shape [0] gives no response,
only the final flag. Written against Triton's Python-backend API only, so the same file runs on Triton and on kiln.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

# Provided by the server running the model: Triton's Python backend, or kiln's compatible module.
import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]  # exists only inside a server


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        self._senders: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)
            delays = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy().reshape(-1)
            wait = pb_utils.get_input_tensor_by_name(request, "WAIT").as_numpy().reshape(-1)
            if delays.size != values.size:
                raise pb_utils.TritonModelException(f"DELAY has {delays.size} elements; it needs one per element "
                                                    f"of IN ({values.size})")
            thread = threading.Thread(target=self._respond, args=(request.get_response_sender(), values, delays),
                                      daemon=True)
            with self._lock:
                self._senders.add(thread)
            thread.start()
            time.sleep(float(wait[0]) / 1000 if wait.size else 0.0)
        return None

    def _respond(self, sender: Any, values: np.ndarray, delays: np.ndarray) -> None:
        try:
            for index, (value, delay) in enumerate(zip(values, delays, strict=True)):
                time.sleep(float(delay) / 1000)
                if sender.is_cancelled():
                    break
                sender.send(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("OUT", np.array([value], dtype=np.int32)),
                    pb_utils.Tensor("IDX", np.array([index], dtype=np.uint32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        finally:
            with self._lock:
                self._senders.discard(threading.current_thread())

    def finalize(self) -> None:
        """Wait (a bounded time) for the threads still sending responses."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with self._lock:
                if not self._senders:
                    return
            time.sleep(0.01)
