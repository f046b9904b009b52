"""The Python engine: Triton and kiln model APIs, initialize args, response checks, errors and lifecycle."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.config import config_to_json, open_model_dir
from kiln.engines import EngineOptions, create_engine
from kiln.engines.python import PythonEngine
from kiln.errors import (
    AlreadyExistsError,
    CancelledError,
    ConfigError,
    InternalError,
    InvalidArgumentError,
    KilnError,
    NotFoundError,
    UnavailableError,
    UnknownError,
    UnsupportedError,
)

WriteModel = Callable[..., Path]

ONE_IN_ONE_OUT = """
backend: "python"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_INT32 dims: [ 2 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 2 ] }, { name: "Z" data_type: TYPE_INT32 dims: [ 2 ] } ]
"""

TRITON_HEADER = """
import numpy as np
import triton_python_backend_utils as pb_utils

def x(request):
    return pb_utils.get_input_tensor_by_name(request, "X").as_numpy()

def reply(**tensors):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, a) for n, a in tensors.items()])
"""


def _engine(folder: Path, options: EngineOptions | None = None) -> PythonEngine:
    model_dir = open_model_dir(folder)
    engine = create_engine(model_dir.spec, model_dir.model_file(1), options)
    assert isinstance(engine, PythonEngine)
    return engine


def _triton(write_model: WriteModel, execute_body: str, config: str = ONE_IN_ONE_OUT) -> PythonEngine:
    source = TRITON_HEADER + "\nclass TritonPythonModel:\n    def execute(self, requests):\n" + "".join(
        f"        {line}\n" for line in execute_body.strip().splitlines())
    return _engine(write_model("m", source, config))


X = np.array([[1, 2], [3, 4]], dtype=np.int32)


def test_triton_add_sub_runs_a_batch(add_sub: Path) -> None:
    with kiln.load(add_sub) as engine:
        assert isinstance(engine, PythonEngine) and engine.thread_safe is False
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        b = np.full((3, 4), 0.5, dtype=np.float32)
        out = engine.infer({"INPUT0": a, "INPUT1": b})
        assert list(out) == ["OUTPUT0", "OUTPUT1"]
        np.testing.assert_array_equal(out["OUTPUT0"], a + b)
        np.testing.assert_array_equal(out["OUTPUT1"], a - b)
        assert out["OUTPUT0"].dtype == np.float32
        only = engine.infer({"INPUT0": a[:1], "INPUT1": b[:1]}, outputs=["OUTPUT1"])
        assert list(only) == ["OUTPUT1"]


def test_initialize_gets_tritons_args(add_sub: Path) -> None:
    engine = _engine(add_sub)
    args = engine._model.args
    assert set(args) == {"model_config", "model_instance_kind", "model_instance_name", "model_instance_device_id",
                         "model_repository", "model_version", "model_name"}
    assert all(isinstance(v, str) for v in args.values())
    assert json.loads(args["model_config"]) == config_to_json(engine.spec.config)
    assert (args["model_instance_kind"], args["model_instance_name"], args["model_instance_device_id"]) == (
        "CPU", "add_sub_0_0", "0")
    assert (args["model_repository"], args["model_version"], args["model_name"]) == (str(add_sub), "1", "add_sub")
    gpu = _engine(add_sub, EngineOptions(kind="gpu", device_id=1, extra={"instance_name": "add_sub_0_3"}))
    assert (gpu._model.args["model_instance_kind"], gpu._model.args["model_instance_device_id"],
            gpu._model.args["model_instance_name"]) == ("GPU", "1", "add_sub_0_3")


def test_kiln_api_model(write_model: WriteModel) -> None:
    source = """
    import numpy as np
    from kiln.errors import InvalidArgumentError

    class KilnModel:
        def execute(self, requests):
            answers = []
            for request in requests:
                x = request.inputs["X"]
                if (x < 0).any():
                    answers.append(InvalidArgumentError("X must not be negative"))
                else:
                    answers.append({name: x * 2 for name in request.requested_outputs})
            return answers
    """
    engine = _engine(write_model("m", source, ONE_IN_ONE_OUT))
    out = engine.infer({"X": X}, outputs=["Z"])
    assert list(out) == ["Z"]
    np.testing.assert_array_equal(out["Z"], X * 2)
    with pytest.raises(InvalidArgumentError, match="model 'm': X must not be negative"):
        engine.infer({"X": -X})


def test_bytes_reach_the_model_as_bytes_and_come_back_as_bytes(write_model: WriteModel) -> None:
    config = """
    backend: "python"
    input [ { name: "S" data_type: TYPE_STRING dims: [ 2 ] } ]
    output [ { name: "T" data_type: TYPE_STRING dims: [ 2 ] } ]
    """
    source = """
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            s = pb_utils.get_input_tensor_by_name(requests[0], "S").as_numpy()
            assert s.dtype == np.object_ and all(type(v) is bytes for v in s), s
            upper = np.array([v.decode().upper() for v in s], dtype=np.object_)  # str elements
            return [pb_utils.InferenceResponse([pb_utils.Tensor("T", upper)])]
    """
    engine = _engine(write_model("m", source, config))
    out = engine.infer({"S": np.array(["ab", "ünï"])})["T"]
    assert out.dtype == np.object_ and out.tolist() == [b"AB", "ÜNÏ".encode()]


def test_async_execute_is_awaited(write_model: WriteModel) -> None:
    source = TRITON_HEADER + """
class TritonPythonModel:
    async def execute(self, requests):
        return [reply(Y=x(r) + 1, Z=x(r)) for r in requests]
"""
    engine = _engine(write_model("m", source, ONE_IN_ONE_OUT))
    np.testing.assert_array_equal(engine.infer({"X": X})["Y"], X + 1)


def test_exception_in_execute_is_internal_and_the_engine_keeps_working(write_model: WriteModel) -> None:
    engine = _triton(write_model, """
if (x(requests[0]) == 0).any():
    raise ValueError("zero is not allowed")
return [reply(Y=x(requests[0]), Z=x(requests[0]))]
""")
    with pytest.raises(InternalError, match=r"model 'm': model.py execute\(\) raised ValueError: zero is not allowed"):
        engine.infer({"X": np.zeros((1, 2), np.int32)})
    np.testing.assert_array_equal(engine.infer({"X": X})["Y"], X)


def test_triton_model_exception_is_internal(write_model: WriteModel) -> None:
    engine = _triton(write_model, 'raise pb_utils.TritonModelException("cannot do that")')
    with pytest.raises(InternalError, match="TritonModelException: cannot do that"):
        engine.infer({"X": X})


@pytest.mark.parametrize(("code", "error"), [
    ("UNKNOWN", UnknownError), ("INTERNAL", InternalError), ("NOT_FOUND", NotFoundError),
    ("INVALID_ARG", InvalidArgumentError), ("UNAVAILABLE", UnavailableError), ("UNSUPPORTED", UnsupportedError),
    ("ALREADY_EXISTS", AlreadyExistsError), ("CANCELLED", CancelledError),
])
def test_triton_error_in_a_response_keeps_its_code(write_model: WriteModel, code: str,
                                                   error: type[KilnError]) -> None:
    engine = _triton(write_model, f"""
return [pb_utils.InferenceResponse(error=pb_utils.TritonError("bad row", pb_utils.TritonError.{code}))]
""")
    with pytest.raises(error, match="^model 'm': bad row$") as raised:
        engine.infer({"X": X})
    assert type(raised.value) is error


def test_triton_error_defaults_to_internal(write_model: WriteModel) -> None:
    engine = _triton(write_model, 'return [pb_utils.InferenceResponse(error=pb_utils.TritonError("oops"))]')
    with pytest.raises(InternalError, match="model 'm': oops"):
        engine.infer({"X": X})


@pytest.mark.parametrize(("body", "error", "message"), [
    ("return reply(Y=x(requests[0]))", InternalError, "must return a list with one InferenceResponse per request"),
    ("return []", InternalError, r"returned 0 responses for 1 request\(s\)"),
    ("return [{'Y': x(requests[0])}]", InternalError, "must return pb_utils.InferenceResponse objects; found dict"),
    ("return None", InternalError, "returned None; return one response per request, or set "
     "model_transaction_policy"),
    ("return [reply(Y=x(requests[0]), W=x(requests[0]))]", InternalError,
     "returned output 'W', which the config does not declare"),
    ("return [reply(Z=x(requests[0]))]", InternalError, "did not return output 'Y', which the request asked for"),
    ("return [reply(Y=x(requests[0]).astype(np.int64), Z=x(requests[0]))]", InternalError,
     r"output 'Y' has dtype int64; the config declares TYPE_INT32 .* \.astype\(np\.int32\)"),
    ("return [reply(Y=x(requests[0])[:1], Z=x(requests[0]))]", InternalError,
     r"output 'Y' has shape \[1, 2\]; the config expects \[2, 2\]"),
    ("return [reply(Y=x(requests[0])[:, :1], Z=x(requests[0]))]", InternalError,
     r"output 'Y' has shape \[2, 1\]; the config expects \[2, 2\]"),
    ("return [pb_utils.InferenceResponse([pb_utils.Tensor('Y', x(requests[0]))] * 2)]", InternalError,
     "returned output 'Y' twice"),
    ("return [pb_utils.InferenceResponse([x(requests[0])])]", InternalError, "must be pb_utils.Tensor objects"),
])
def test_bad_responses_name_the_model_and_the_problem(write_model: WriteModel, body: str, error: type[KilnError],
                                                      message: str) -> None:
    engine = _triton(write_model, body)
    with pytest.raises(error, match=f"^model 'm': .*{message}"):
        engine.infer({"X": X})


def test_outputs_nobody_asked_for_are_dropped(write_model: WriteModel) -> None:
    engine = _triton(write_model, "return [reply(Y=x(requests[0]), Z=x(requests[0]) * 3)]")
    assert list(engine.infer({"X": X}, outputs=["Z"])) == ["Z"]


def test_requests_carry_the_batch_and_the_requested_outputs(write_model: WriteModel) -> None:
    engine = _triton(write_model, """
assert len(requests) == 1
request = requests[0]
assert request.requested_output_names() == ["Z"], request.requested_output_names()
assert (request.request_id(), request.correlation_id(), request.flags()) == ("", 0, 0)
assert request.parameters() == "{}" and not request.is_cancelled()
return [reply(Z=x(request))]
""")
    assert engine.infer({"X": X}, outputs=["Z"])["Z"].shape == (2, 2)


def test_calling_another_model_needs_a_server(write_model: WriteModel) -> None:
    engine = _triton(write_model, """
other = pb_utils.InferenceRequest(model_name="other", requested_output_names=["Y"], inputs=requests[0].inputs())
return [other.exec()]
""")
    with pytest.raises(UnsupportedError, match=r"^model 'm': calling model 'other' from execute \(BLS\) needs a kiln "):
        engine.infer({"X": X})


def test_close_runs_finalize_once_then_refuses(write_model: WriteModel, tmp_path: Path) -> None:
    marker = tmp_path / "finalized"
    source = TRITON_HEADER + f"""
class TritonPythonModel:
    def execute(self, requests):
        return [reply(Y=x(r), Z=x(r)) for r in requests]

    def finalize(self):
        with open({str(marker)!r}, "a") as f:
            f.write("done\\n")
"""
    engine = _engine(write_model("m", source, ONE_IN_ONE_OUT))
    engine.close()
    engine.close()
    assert marker.read_text() == "done\n"
    with pytest.raises(UnavailableError, match="model 'm': the engine is closed"):
        engine.infer({"X": X})


def test_failing_finalize_is_logged_not_raised(write_model: WriteModel, caplog: pytest.LogCaptureFixture) -> None:
    source = TRITON_HEADER + """
class TritonPythonModel:
    def execute(self, requests):
        return []

    def finalize(self):
        raise RuntimeError("disk gone")
"""
    engine = _engine(write_model("m", source, ONE_IN_ONE_OUT))
    with caplog.at_level(logging.ERROR, logger="kiln.engines.python"):
        engine.close()
    assert "model 'm': model.py finalize() raised RuntimeError: disk gone" in caplog.text


@pytest.mark.parametrize(("source", "error", "message"), [
    ("def broken(:\n", ConfigError, r"importing .*model.py failed: SyntaxError"),
    ("import no_such_module_for_kiln\n", ConfigError, "ModuleNotFoundError: No module named 'no_such_module_for_kiln'"),
    ("X = 1\n", ConfigError, "defines neither class TritonPythonModel"),
    ("class TritonPythonModel:\n    def execute(self, r): return r\nclass KilnModel(TritonPythonModel): pass\n",
     ConfigError, "defines both class TritonPythonModel"),
    ("class TritonPythonModel:\n    pass\n", ConfigError, r"has no execute\(self, requests\) method"),
    ("class TritonPythonModel:\n    def initialize(self, args): raise KeyError('weights')\n"
     "    def execute(self, r): return r\n", InternalError, r"model.py initialize\(\) raised KeyError: 'weights'"),
    ("class TritonPythonModel:\n    def __init__(self): raise OSError('no gpu')\n    def execute(self, r): return r\n",
     InternalError, r"model.py TritonPythonModel\(\) raised OSError: no gpu"),
])
def test_load_failures_name_the_model_and_the_cause(write_model: WriteModel, source: str, error: type[KilnError],
                                                     message: str) -> None:
    folder = write_model("m", source, ONE_IN_ONE_OUT)
    with pytest.raises(error, match=f"^model 'm': .*{message}"):
        _engine(folder)


def test_missing_model_file(write_model: WriteModel) -> None:
    folder = write_model("m", "", ONE_IN_ONE_OUT)
    spec = open_model_dir(folder).spec
    with pytest.raises(ConfigError, match="model 'm': model file .*2/model.py does not exist"):
        create_engine(spec, folder / "2" / "model.py")


def test_a_decoupled_model_refuses_one_response_calls(add_sub: Path) -> None:
    (add_sub / "config.pbtxt").write_text((add_sub / "config.pbtxt").read_text()
                                          + "model_transaction_policy { decoupled: true }\n")
    with _engine(add_sub) as engine, pytest.raises(UnsupportedError, match="model 'add_sub' is decoupled"):
        engine.infer({"INPUT0": np.ones((1, 4), np.float32), "INPUT1": np.ones((1, 4), np.float32)})


def test_a_decoupled_model_needs_tritons_api(write_model: WriteModel) -> None:
    folder = write_model("m", "class KilnModel:\n    def execute(self, requests):\n        return []\n",
                         ONE_IN_ONE_OUT + "model_transaction_policy { decoupled: true }\n")
    with pytest.raises(UnsupportedError, match="model 'm': a decoupled model .* TritonPythonModel"):
        _engine(folder)


def test_execution_environments_are_ignored_with_a_warning(add_sub: Path, caplog: pytest.LogCaptureFixture) -> None:
    (add_sub / "config.pbtxt").write_text((add_sub / "config.pbtxt").read_text()
                                          + 'parameters { key: "EXECUTION_ENV_PATH" value { string_value: "e.tgz" } }')
    with caplog.at_level(logging.WARNING, logger="kiln.engines.python"):
        _engine(add_sub).close()
    assert "parameter EXECUTION_ENV_PATH is ignored" in caplog.text
