"""auto_complete_config: a Python model completes its own configuration while kiln reads the model folder."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.config import open_model_dir
from kiln.engines.python.model_config import ModelConfig
from kiln.errors import ConfigError
from kiln.tensor import DataType

WriteModel = Callable[..., Path]

AUTO_COMPLETE = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        config = auto_complete_model_config.as_dict()
        declared = [t["name"] for t in config["input"]]
        for tensor in ({"name": "IN", "data_type": "TYPE_FP32", "dims": [3]},
                       {"name": "EXTRA", "data_type": "TYPE_INT64", "dims": [1], "optional": True}):
            if tensor["name"] not in declared:
                auto_complete_model_config.add_input(tensor)
        auto_complete_model_config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [3]})
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 2)]) for r in requests]
"""


def test_a_model_without_config_pbtxt_completes_itself(write_model: WriteModel) -> None:
    spec = open_model_dir(write_model("auto", AUTO_COMPLETE)).spec
    assert (spec.backend, spec.max_batch_size) == ("python", 4)
    assert [(t.name, t.datatype, t.dims, t.optional) for t in spec.inputs] == [
        ("IN", DataType.FP32, (3,), False), ("EXTRA", DataType.INT64, (1,), True)]
    assert [(t.name, t.datatype, t.dims) for t in spec.outputs] == [("OUT", DataType.FP32, (3,))]
    assert spec.config.HasField("dynamic_batching")
    with kiln.load(write_model("auto", AUTO_COMPLETE)) as engine:
        x = np.ones((2, 3), np.float32)
        np.testing.assert_array_equal(engine.infer({"IN": x})["OUT"], x * 2)


def test_a_partial_config_is_completed(write_model: WriteModel) -> None:
    config = """
    name: "auto"
    backend: "python"
    input [ { name: "IN" data_type: TYPE_FP32 dims: [ 3 ] } ]
    parameters { key: "kept" value { string_value: "yes" } }
    """
    spec = open_model_dir(write_model("auto", AUTO_COMPLETE, config)).spec
    assert [t.name for t in spec.inputs] == ["IN", "EXTRA"] and [t.name for t in spec.outputs] == ["OUT"]
    assert spec.parameters["kept"] == "yes" and spec.max_batch_size == 4


@pytest.mark.parametrize(("config", "message"), [
    ('output [ { name: "OUT" data_type: TYPE_INT8 dims: [ 3 ] } ]',
     "output 'OUT' is TYPE_INT8 in the configuration, but auto_complete_config says TYPE_FP32"),
    ('output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 5 ] } ]',
     r"output 'OUT' has dims \[5\] in the configuration, but auto_complete_config says \[3\]"),
    ("max_batch_size: 16", "sets max_batch_size 16, but auto_complete_config sets 4"),
    ("sequence_batching { }", "chooses sequence_batching, so auto_complete_config cannot set dynamic_batching"),
])
def test_conflicts_with_the_config_fail_the_load(write_model: WriteModel, config: str, message: str) -> None:
    folder = write_model("auto", AUTO_COMPLETE, 'backend: "python"\n' + config)
    with pytest.raises(ConfigError, match=f"model 'auto': auto_complete_config in .* raised ValueError: .*{message}"):
        open_model_dir(folder)


def test_auto_complete_must_return_the_config(write_model: WriteModel) -> None:
    source = AUTO_COMPLETE.replace("return auto_complete_model_config", "return None")
    with pytest.raises(ConfigError, match="returned NoneType; it must return the pb_utils.ModelConfig it was given"):
        open_model_dir(write_model("auto", source))


def test_an_invalid_completed_config_is_a_config_error(write_model: WriteModel) -> None:
    source = AUTO_COMPLETE.replace('"TYPE_FP32", "dims": [3]})\n        auto_complete_model_config.set_max',
                                   '"TYPE_FLOAT", "dims": [3]})\n        auto_complete_model_config.set_max')
    with pytest.raises(ConfigError, match="produced a configuration that is not a valid ModelConfig"):
        open_model_dir(write_model("auto", source))


def test_auto_complete_can_be_turned_off(write_model: WriteModel) -> None:
    with pytest.raises(ConfigError, match="no output is declared"):
        open_model_dir(write_model("auto", AUTO_COMPLETE), autocomplete=False)


def test_the_newest_served_version_is_asked_and_forgotten(write_model: WriteModel) -> None:
    folder = write_model("auto", AUTO_COMPLETE, versions=(1, 2))
    (folder / "1" / "model.py").write_text("raise RuntimeError('version 1 must not be imported')\n")
    before = set(sys.modules)
    assert open_model_dir(folder).spec.outputs[0].name == "OUT"
    assert not [name for name in set(sys.modules) - before if name.startswith("kiln_python_model")]


def test_a_broken_model_py_fails_while_reading_the_folder(write_model: WriteModel) -> None:
    with pytest.raises(ConfigError, match=r"model 'auto': importing .*2/model.py failed: ZeroDivisionError"):
        open_model_dir(write_model("auto", "1 / 0\n", 'backend: "python"', versions=(2,)))


def test_model_config_object_semantics() -> None:
    config = ModelConfig('{"name": "m", "input": [{"name": "A", "data_type": "TYPE_INVALID", "dims": []}]}')
    config.add_input({"name": "A", "data_type": "TYPE_INT32", "dims": (2,)})  # fills the declared entry
    assert config.as_dict()["input"] == [{"name": "A", "data_type": "TYPE_INT32", "dims": [2]}]
    config.add_output({"name": "B", "data_type": "TYPE_STRING", "dims": [-1]})
    config.set_max_batch_size(8)
    config.set_model_transaction_policy({"decoupled": False})
    assert config.as_dict()["max_batch_size"] == 8
    assert config.as_dict()["model_transaction_policy"] == {"decoupled": False}
    with pytest.raises(ValueError, match="cannot change it"):
        config.set_model_transaction_policy({"decoupled": True})
    with pytest.raises(ValueError, match="model 'm': output 'C' has the property 'optional'"):
        config.add_output({"name": "C", "data_type": "TYPE_FP32", "dims": [1], "optional": True})
    with pytest.raises(ValueError, match="input 'D' from auto_complete_config has no 'dims'"):
        config.add_input({"name": "D", "data_type": "TYPE_FP32"})
    with pytest.raises(ValueError, match="key 'sync' is not supported"):
        config.set_model_transaction_policy({"sync": True})
