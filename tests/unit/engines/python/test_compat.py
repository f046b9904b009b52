"""kiln's triton_python_backend_utils: the API a Triton Python model uses, without a server."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
import pytest

from kiln.engines.python import compat as pb_utils
from kiln.engines.python.loader import COMPAT_MODULE, import_model_file
from kiln.errors import UnsupportedError


def test_tensor_wraps_an_array_without_copying() -> None:
    array = np.arange(6, dtype=np.int16).reshape(2, 3)
    tensor = pb_utils.Tensor("T", array)
    assert tensor.name() == "T" and tensor.as_numpy() is array
    assert tensor.shape() == [2, 3] and tensor.is_cpu()
    assert tensor.triton_dtype() == 7 == pb_utils.numpy_to_triton_type(np.int16)


def test_tensor_refuses_numpy_unicode_strings() -> None:
    with pytest.raises(pb_utils.TritonModelException, match="use dtype=np.object_") as raised:
        pb_utils.Tensor("S", np.array(["a", "b"]))
    assert "tensor 'S'" in raised.value.message()


def test_dlpack_round_trip_through_numpy_and_torch() -> None:
    torch = pytest.importorskip("torch")
    array = np.arange(4, dtype=np.float32)
    tensor = pb_utils.Tensor("T", array)
    shared = torch.from_dlpack(tensor.to_dlpack())
    shared[0] = 42.0
    assert array[0] == 42.0  # zero-copy
    np.testing.assert_array_equal(np.from_dlpack(tensor), array)
    back = pb_utils.Tensor.from_dlpack("U", torch.utils.dlpack.to_dlpack(torch.ones(3, dtype=torch.int64)))
    assert back.name() == "U" and back.as_numpy().tolist() == [1, 1, 1]
    assert pb_utils.Tensor.from_dlpack("V", torch.zeros(2)).as_numpy().dtype == np.float32


def test_dlpack_of_a_read_only_input_hands_over_a_copy() -> None:
    frozen = np.frombuffer(np.arange(3, dtype=np.int32).tobytes(), dtype=np.int32)
    assert not frozen.flags.writeable
    np.testing.assert_array_equal(np.from_dlpack(pb_utils.Tensor("T", frozen)), [0, 1, 2])
    with pytest.raises(pb_utils.TritonModelException, match="BYTES tensors have no DLPack form"):
        pb_utils.Tensor("S", np.array([b"x"], dtype=object)).to_dlpack()


def test_request_accessors_and_lookups() -> None:
    x = pb_utils.Tensor("X", np.zeros(2))
    request = pb_utils.InferenceRequest(inputs=[x], requested_output_names=["Y"], request_id="r1",
                                        correlation_id=5, flags=pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
                                        parameters={"k": "v", "n": 1})
    assert pb_utils.get_input_tensor_by_name(request, "X") is x
    assert pb_utils.get_input_tensor_by_name(request, "nope") is None
    assert request.requested_output_names() == ["Y"] and request.request_id() == "r1"
    assert (request.correlation_id(), request.flags()) == (5, 1)
    assert json.loads(request.parameters()) == {"k": "v", "n": 1}
    assert not request.is_cancelled()


def test_response_senders_are_for_decoupled_models() -> None:
    request = pb_utils.InferenceRequest(model_name="other", requested_output_names=["Y"], inputs=[])
    with pytest.raises(UnsupportedError, match=r"model 'other': get_response_sender\(\) is for decoupled models"):
        request.get_response_sender()
    with pytest.raises(UnsupportedError, match="calling model 'other' from execute \\(BLS\\) needs a kiln server"):
        request.exec(decoupled=True)


def test_bls_outside_a_server_says_it_needs_one() -> None:
    request = pb_utils.InferenceRequest(model_name="other", requested_output_names=["Y"], inputs=[])
    with pytest.raises(UnsupportedError, match="calling model 'other' from execute \\(BLS\\) needs a kiln server"):
        request.exec()


def test_response_and_error() -> None:
    y = pb_utils.Tensor("Y", np.ones(1))
    response = pb_utils.InferenceResponse(output_tensors=[y])
    assert not response.has_error() and response.error() is None
    assert pb_utils.get_output_tensor_by_name(response, "Y") is y
    assert pb_utils.get_output_tensor_by_name(response, "Z") is None
    failed = pb_utils.InferenceResponse(error=pb_utils.TritonError("no file", pb_utils.TritonError.NOT_FOUND))
    assert failed.has_error() and failed.output_tensors() == []
    error = failed.error()
    assert error is not None and (error.message(), error.code(), str(error)) == ("no file", 2, "no file")
    assert pb_utils.TritonError("x").code() == pb_utils.TritonError.INTERNAL
    with pytest.raises(pb_utils.TritonModelException, match="must be a list"):
        pb_utils.InferenceResponse(output_tensors=y)  # type: ignore[arg-type]  # the mistake under test


def test_error_codes_are_tritons() -> None:
    codes = {name: getattr(pb_utils.TritonError, name) for name in (
        "UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED", "ALREADY_EXISTS", "CANCELLED")}
    assert list(codes.values()) == list(range(8))


def test_config_helpers() -> None:
    config = {"input": [{"name": "A", "data_type": "TYPE_STRING"}],
              "output": [{"name": "B", "data_type": "TYPE_FP16"}]}
    assert pb_utils.get_input_config_by_name(config, "A") == config["input"][0]
    assert pb_utils.get_output_config_by_name(config, "B") == config["output"][0]
    assert pb_utils.get_output_config_by_name(config, "A") is None
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    assert pb_utils.triton_string_to_numpy("TYPE_FP16") is np.float16
    assert pb_utils.triton_string_to_numpy("TYPE_BOOL") is bool
    assert pb_utils.triton_to_numpy_type(8) is np.int32 and pb_utils.triton_to_numpy_type(99) is None
    assert pb_utils.numpy_to_triton_type(np.object_) == 13 and pb_utils.numpy_to_triton_type(np.complex64) is None
    assert not pb_utils.using_decoupled_model_transaction_policy(config)
    assert pb_utils.using_decoupled_model_transaction_policy({"model_transaction_policy": {"decoupled": True}})


def test_bytes_serialization_round_trip() -> None:
    strings = np.array([b"kiln", b"", "ü".encode()], dtype=object)
    flat = pb_utils.serialize_byte_tensor(strings)
    assert flat is not None and flat.dtype == np.uint8
    assert flat.tobytes()[:8] == b"\x04\x00\x00\x00kiln"
    assert pb_utils.deserialize_bytes_tensor(flat.tobytes()).tolist() == strings.tolist()
    assert pb_utils.serialize_byte_tensor(np.zeros(2)) is None


def test_logger_writes_to_python_logging(caplog: pytest.LogCaptureFixture) -> None:
    logger = pb_utils.Logger
    with caplog.at_level(logging.DEBUG, logger="kiln.python_model"):
        logger.log_info("info")
        logger.log_warn("warn")
        logger.log_error("error")
        logger.log_verbose("verbose")
        logger.log("explicit", logger.WARNING)
        logger.log("default level")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "info"), (logging.WARNING, "warn"), (logging.ERROR, "error"), (logging.DEBUG, "verbose"),
        (logging.WARNING, "explicit"), (logging.INFO, "default level")]
    assert {r.funcName for r in caplog.records} == {"test_logger_writes_to_python_logging"}  # the model's line


def test_the_module_is_what_model_py_imports(add_sub: Path) -> None:
    module = import_model_file("add_sub", add_sub / "1" / "model.py")
    try:
        assert sys.modules[COMPAT_MODULE] is pb_utils
        assert module.module.pb_utils is pb_utils
    finally:
        module.unload()
