"""Write Python model folders (model.py + config.pbtxt) for the Python backend's tests."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

WriteModel = Callable[..., Path]

ADD_SUB_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

# Triton's add_sub example in spirit: the Python-backend API only.
ADD_SUB_TRITON = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.args = args
        config = json.loads(args["model_config"])
        self.dtype = pb_utils.triton_string_to_numpy(pb_utils.get_output_config_by_name(config, "OUTPUT0")["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            out0 = pb_utils.Tensor("OUTPUT0", (a + b).astype(self.dtype))
            out1 = pb_utils.Tensor("OUTPUT1", (a - b).astype(self.dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out0, out1]))
        return responses
"""


@pytest.fixture
def write_model(tmp_path: Path) -> WriteModel:
    """``write_model(name, source, config=None, versions=(1,))``: the model folder under ``tmp_path``."""

    def write(name: str, source: str, config: str | None = None, versions: Iterable[int] = (1,)) -> Path:
        folder = tmp_path / name
        folder.mkdir(parents=True, exist_ok=True)
        if config is not None:
            (folder / "config.pbtxt").write_text(textwrap.dedent(config))
        for version in versions:
            (folder / str(version)).mkdir(exist_ok=True)
            (folder / str(version) / "model.py").write_text(textwrap.dedent(source))
        return folder

    return write


@pytest.fixture
def add_sub(write_model: WriteModel) -> Path:
    """A Triton add/sub model (FP32, dims [4], max_batch_size 8) at ``<tmp>/add_sub``."""
    return write_model("add_sub", ADD_SUB_TRITON, ADD_SUB_CONFIG)
