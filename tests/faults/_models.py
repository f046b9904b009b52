"""Model folders the fault tests serve: Python models that die or raise on chosen input values."""

from __future__ import annotations

from pathlib import Path

CRASHING_MODEL = '''
import ctypes
import os
import signal

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.pid = os.getpid()

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if (x == 3).any():
                os._exit(3)
            if (x == 9).any():
                os.kill(os.getpid(), signal.SIGKILL)
            if (x == 11).any():
                ctypes.string_at(0)  # reads address 0: a segmentation fault
            pid = np.full(x.shape, self.pid, dtype=np.int64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2), pb_utils.Tensor("PID", pid)]))
        return responses
'''

CRASHING_CONFIG = '''
backend: "python"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_INT64 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT64 dims: [ 1 ] }, { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] } ]
parameters { key: "KILN_EXECUTION_ISOLATION" value { string_value: "process" } }
parameters { key: "KILN_MAX_RESTARTS" value { string_value: "%d" } }
'''

RAISING_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if (x < 0).any():
                raise ValueError("negative input")
            rows = np.full(x.shape, x.shape[0], dtype=np.int64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x), pb_utils.Tensor("ROWS", rows)]))
        return responses
'''

RAISING_CONFIG = '''
backend: "python"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_INT64 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT64 dims: [ 1 ] }, { name: "ROWS" data_type: TYPE_INT64 dims: [ 1 ] } ]
dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 3000000 }
'''

IDENTITY_CONFIG = '''
backend: "identity"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_INT64 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT64 dims: [ 1 ] } ]
'''


def write_python_model(repo: Path, name: str, config: str, source: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    (repo / name / "1" / "model.py").write_text(source)


def write_identity_model(repo: Path, name: str = "steady") -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(IDENTITY_CONFIG)
