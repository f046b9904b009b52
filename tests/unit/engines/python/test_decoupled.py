"""Decoupled Python models at the engine: response senders, the final flag, execute's contract and its failures."""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.config import open_model_dir
from kiln.engines import create_engine
from kiln.engines.python import PythonEngine
from kiln.engines.python.decoupled import DecoupledCall
from kiln.errors import ConfigError, InternalError, KilnError

CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "TWICE" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

HEADER = """
import numpy as np
import triton_python_backend_utils as pb_utils

def n(request):
    return int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])

def out(value):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], np.int32)),
                                       pb_utils.Tensor("TWICE", np.array([2 * value], np.int32))])

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
"""


class Collected:
    """A response sink that keeps what it gets, as the server's stream would deliver it."""

    def __init__(self) -> None:
        self.items: list[tuple[dict[str, Any] | None, KilnError | None, bool]] = []
        self.cancelled = False
        self.done = threading.Event()

    def put(self, outputs: Mapping[str, Any] | None, error: KilnError | None, final: bool) -> None:
        self.items.append((None if outputs is None else {k: v.tolist() for k, v in outputs.items()}, error, final))
        if final:
            self.done.set()


def _engine(write_model: Any, body: str) -> PythonEngine:
    source = HEADER + "\nclass TritonPythonModel:\n    def execute(self, requests):\n" + "".join(
        f"        {line}\n" for line in body.strip().splitlines())
    folder = write_model("d", source, CONFIG)
    model_dir = open_model_dir(folder)
    engine = create_engine(model_dir.spec, model_dir.model_file(1))
    assert isinstance(engine, PythonEngine)
    return engine


def _run(engine: PythonEngine, value: int, outputs: tuple[str, ...] = ("OUT", "TWICE")) -> Collected:
    sink = Collected()
    engine.execute_decoupled([DecoupledCall({"N": np.array([value], np.int32)}, outputs, sink)])
    return sink


def test_responses_then_the_final_flag_alone(write_model: Any) -> None:
    engine = _engine(write_model, """
sender = requests[0].get_response_sender()
for i in range(n(requests[0])):
    sender.send(out(i))
sender.send(flags=FINAL)
""")
    sink = _run(engine, 2, ("OUT",))
    assert sink.items == [({"OUT": [0]}, None, False), ({"OUT": [1]}, None, False), (None, None, True)]
    assert _run(engine, 0).items == [(None, None, True)]  # zero responses: the final flag alone


def test_responses_may_come_after_execute_returned(write_model: Any) -> None:
    engine = _engine(write_model, """
sender = requests[0].get_response_sender()
def later():
    sender.send(out(7), flags=FINAL)
import threading
threading.Timer(0.05, later).start()
return None
""")
    sink = _run(engine, 1)
    assert sink.items == []
    assert sink.done.wait(5)
    assert sink.items == [({"OUT": [7], "TWICE": [14]}, None, True)]


def test_the_sender_refuses_what_triton_refuses(write_model: Any) -> None:
    engine = _engine(write_model, """
sender = requests[0].get_response_sender()
sender.send(out(1), flags=FINAL)
try:
    sender.send(out(2))
except pb_utils.TritonModelException as exc:
    closed = str(exc)
try:
    pb_utils.InferenceRequest().get_response_sender()
except Exception as exc:
    closed += " | " + str(exc)
raise pb_utils.TritonModelException(closed)
""")
    sink = Collected()
    with pytest.raises(InternalError, match="Response sender has been closed.* get_response_sender\\(\\) is for "
                                            "decoupled models"):
        engine.execute_decoupled([DecoupledCall({"N": np.array([1], np.int32)}, ["OUT"], sink)])
    assert sink.items == [({"OUT": [1]}, None, True)]  # ended already: the failure adds nothing


def test_an_error_response_does_not_end_the_request(write_model: Any) -> None:
    engine = _engine(write_model, """
sender = requests[0].get_response_sender()
sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("no luck", pb_utils.TritonError.INVALID_ARG)))
sender.send(out(3), flags=FINAL)
""")
    (_, error, final), second = _run(engine, 1, ("OUT",)).items
    assert error is not None and error.message == "model 'd': no luck" and error.code.name == "INVALID_ARG"
    assert not final and second == ({"OUT": [3]}, None, True)


def test_a_malformed_response_reaches_the_client_and_the_model(write_model: Any) -> None:
    engine = _engine(write_model, """
sender = requests[0].get_response_sender()
try:
    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1.5], np.float32))]))
except pb_utils.TritonModelException:
    sender.send(flags=FINAL)
""")
    (_, error, _), last = _run(engine, 1, ("OUT",)).items
    assert isinstance(error, InternalError) and "output 'OUT' has dtype float32" in error.message
    assert last == (None, None, True)


def test_a_failed_execute_ends_every_open_request_with_its_error(write_model: Any) -> None:
    engine = _engine(write_model, 'raise pb_utils.TritonModelException("broken")')
    sink = Collected()
    with pytest.raises(InternalError, match="broken"):
        engine.execute_decoupled([DecoupledCall({"N": np.array([1], np.int32)}, ["OUT"], sink)])
    ((outputs, error, final),) = sink.items
    assert outputs is None and error is not None and "broken" in error.message and final


def test_execute_must_return_none(write_model: Any) -> None:
    engine = _engine(write_model, "return [out(1)]")
    sink = Collected()
    with pytest.raises(InternalError, match="returned list; a decoupled model sends responses through"):
        engine.execute_decoupled([DecoupledCall({"N": np.array([1], np.int32)}, ["OUT"], sink)])
    assert sink.items[0][2]  # the request was ended with the error


def test_a_dropped_sender_ends_its_request(write_model: Any, caplog: pytest.LogCaptureFixture) -> None:
    engine = _engine(write_model, "requests[0].get_response_sender().send(out(1))")
    with caplog.at_level(logging.WARNING, logger="kiln.engines.python"):
        sink = _run(engine, 1, ("OUT",))
        gc.collect()
    assert sink.items == [({"OUT": [1]}, None, False), (None, None, True)]
    assert "dropped without the final flag" in caplog.text


def test_decoupled_is_for_the_python_backend(tmp_path: Path) -> None:
    folder = tmp_path / "ident"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(CONFIG.replace('backend: "python"', 'backend: "identity"'))
    with pytest.raises(ConfigError, match="decoupled: true needs a backend .* backend 'identity'"):
        open_model_dir(folder)
