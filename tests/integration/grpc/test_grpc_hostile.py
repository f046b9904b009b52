"""Hostile gRPC input against a real `kiln serve` (in-process gRPC and two gRPC worker processes): oversized
requests that are refused must not stay in memory, bytes that are no request are INVALID_ARGUMENT in one log
line (and one error_message in a stream, which goes on), out-of-range parameters are refused, and an unknown
model is NOT_FOUND before anything else is checked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from kiln.demo import build_demo_repository
from kiln.serve_process import KilnProcess, kiln_serve
from kiln.v2._generated import grpc_service_pb2 as pb

METHOD = "/inference.GRPCInferenceService/"
BIG = 64 * 2**20
WARM_UP = 4
CALLS = 8
# The eight requests held would be 512 MiB. Below that, growth is the allocator's: each of a process's malloc arenas
# may keep up to 64 MiB it freed (docs/serving.md), and which arenas grpc's threads touch varies (15-153 MiB seen).
GROWTH_BOUND = 256 * 2**20


@pytest.fixture(scope="module", params=["in-process", "2 workers"])
def served(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[
        tuple[KilnProcess, Path]]:
    root = tmp_path_factory.mktemp("repo")
    build_demo_repository(root)
    log = root.parent / f"serve-{request.param.replace(' ', '-')}.log"
    workers = "0" if request.param == "in-process" else "2"
    with kiln_serve([root], "--grpc-workers", workers, "--http-workers", "1", log_path=log) as process:
        yield process, log


@pytest.fixture
def channel(served: tuple[KilnProcess, Path]) -> Iterator[grpc.Channel]:
    options = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1)]
    with grpc.insecure_channel(served[0].grpc_url, options=options) as channel:
        yield channel


def _unary(channel: grpc.Channel, name: str) -> grpc.UnaryUnaryMultiCallable:
    return channel.unary_unary(METHOD + name, request_serializer=lambda b: b, response_deserializer=lambda b: b)


def _simple(input0_bytes: int = 64, model: str = "simple", **parameters: int) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name=model)
    for name in ("INPUT0", "INPUT1"):
        tensor = message.inputs.add(name=name, datatype="INT32")
        tensor.shape.extend([1, 16])
    message.raw_input_contents.extend([b"\1" * input0_bytes, b"\1" * 64])
    for key, value in parameters.items():
        message.parameters[key].int64_param = value
    return message


def _refused(call: grpc.UnaryUnaryMultiCallable, payload: bytes) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call(payload)
    return caught.value


def _tree_rss(pid: int) -> int:
    """RSS of the server process and its workers (the workers decode ModelInfer themselves)."""
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


def test_refused_large_requests_do_not_stay_in_memory(served: tuple[KilnProcess, Path],
                                                      channel: grpc.Channel) -> None:
    infer = _unary(channel, "ModelInfer")
    good = _simple().SerializeToString()
    assert pb.ModelInferResponse.FromString(infer(good)).model_name == "simple"
    big = _simple(BIG).SerializeToString()
    contents = _simple()
    del contents.raw_input_contents[:]
    contents.inputs[0].contents.int_contents.extend(range(10**7))  # 10M elements for a shape of 16
    contents.inputs[1].contents.int_contents.extend(range(16))
    many = contents.SerializeToString()
    # grpc's and the allocator's buffers grow to their working size for both kinds of request
    for payload in [big] * WARM_UP + [many]:
        _refused(infer, payload)
    before = _tree_rss(served[0].process.pid)
    for _ in range(CALLS):
        error = _refused(infer, big)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"unexpected total byte size {BIG}" in str(error.details())
    error = _refused(infer, many)
    assert "has 10000000 element(s) in contents.int_contents" in str(error.details())
    growth = _tree_rss(served[0].process.pid) - before
    assert growth < GROWTH_BOUND, f"RSS grew by {growth / 2**20:.0f} MiB after {CALLS + 1} refused requests"
    assert pb.ModelInferResponse.FromString(infer(good)).model_name == "simple"


def test_bytes_that_do_not_parse(served: tuple[KilnProcess, Path], channel: grpc.Channel) -> None:
    error = _refused(_unary(channel, "ModelInfer"), b"\x0a\xff\xff\xff\x0f")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not parse the ModelInfer request" in str(error.details())
    log = served[1].read_text()
    assert "Traceback" not in log and "DecodeError" not in log


def test_stream_answers_bytes_that_do_not_parse_and_goes_on(channel: grpc.Channel) -> None:
    stream = channel.stream_stream(METHOD + "ModelStreamInfer", request_serializer=lambda b: b,
                                   response_deserializer=pb.ModelStreamInferResponse.FromString)
    good = _simple().SerializeToString()
    replies = list(stream(iter([good, b"\x0a\xff\xff\xff\x0f", good])))
    assert [bool(r.error_message) for r in replies] == [False, True, False]
    assert "could not parse the ModelInfer request" in replies[1].error_message
    assert replies[2].infer_response.model_name == "simple"


@pytest.mark.parametrize(("key", "value"), [("priority", -5), ("timeout", -5), ("sequence_id", -1)])
def test_negative_parameters_are_refused(channel: grpc.Channel, key: str, value: int) -> None:
    error = _refused(_unary(channel, "ModelInfer"), _simple(**{key: value}).SerializeToString())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"request parameter '{key}' is {value}; expected an integer 0..{2**64 - 1}" in str(error.details())


def test_unknown_model_is_not_found_before_its_sizes(channel: grpc.Channel) -> None:
    error = _refused(_unary(channel, "ModelInfer"), _simple(10 * 2**20, model="nope").SerializeToString())
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "nope" in str(error.details())


@pytest.mark.parametrize("method", ["ModelMetadata", "ModelConfig", "ModelStatistics", "RepositoryIndex"])
def test_bytes_that_are_no_message_are_invalid_argument_on_every_rpc(channel: grpc.Channel, method: str) -> None:
    error = _refused(_unary(channel, method), b"\x0a\xff\xff\xff\x0f")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"could not parse the {method} request" in str(error.details())


def test_a_shape_beyond_any_array_is_refused(channel: grpc.Channel) -> None:
    request = _simple()
    del request.raw_input_contents[:]
    request.inputs[0].shape[:] = [0, 2**62]
    error = _refused(_unary(channel, "ModelInfer"), request.SerializeToString())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than 1099511627776 elements" in str(error.details())
