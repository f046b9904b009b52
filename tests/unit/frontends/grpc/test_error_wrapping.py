"""Every RPC of GRPCInferenceService goes through the one error wrapper (MLServer once shipped a method without its
decorator; this test makes that impossible here), and the wrapper maps errors through kiln.v2.status."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor

from kiln.errors import InvalidArgumentError, ModelNotFoundError, UnavailableError
from kiln.frontends.grpc.servicer import GRPCInferenceService, answer_in_order, is_wrapped, rpc
from kiln.v2._generated import grpc_service_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
METHODS: list[MethodDescriptor] = list(SERVICE.methods)


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    async def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        self.code, self.details = code, details
        raise Aborted(details)


class FailingServer:
    """Every facade call fails the same way."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> NoReturn:
            raise self.error

        return fail


def _request(method: MethodDescriptor) -> Any:
    return getattr(pb, method.input_type.name)()


def test_the_service_has_the_rpcs_triton_defines() -> None:
    assert len(METHODS) == 20
    assert {m.name for m in METHODS} >= {"ModelInfer", "ModelStreamInfer", "ModelStatistics", "LogSettings"}


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_every_rpc_is_implemented_and_wrapped(method: MethodDescriptor) -> None:
    implementation = GRPCInferenceService.__dict__.get(method.name)
    assert implementation is not None, f"GRPCInferenceService does not implement {method.name}"
    assert is_wrapped(implementation), f"{method.name} is not decorated with @rpc"
    streaming = method.server_streaming
    assert inspect.isasyncgenfunction(implementation) is streaming
    assert inspect.iscoroutinefunction(implementation) is not streaming
    assert method.client_streaming is streaming  # Triton has no client-only or server-only streams


def test_no_public_method_outside_the_service() -> None:
    names = {m.name for m in METHODS}
    public = {name for name in vars(GRPCInferenceService) if name[:1].isupper()}
    assert public == names


def test_an_unwrapped_method_is_detected() -> None:
    async def bare(self: Any, request: Any, context: Any) -> None:
        return None

    assert not is_wrapped(bare)
    assert is_wrapped(rpc(bare))


@pytest.mark.parametrize("method", [m for m in METHODS if not m.server_streaming], ids=lambda m: m.name)
async def test_every_unary_rpc_aborts_with_the_mapped_status(method: MethodDescriptor) -> None:
    service = GRPCInferenceService(FailingServer(UnavailableError("the server is busy")))  # type: ignore[arg-type]
    context = FakeContext()
    with pytest.raises(Aborted):
        await getattr(service, method.name)(_request(method), context)
    assert context.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED)
    if context.code is grpc.StatusCode.UNAVAILABLE:
        assert context.details == "the server is busy"
    else:
        assert "not supported" in context.details


@pytest.mark.parametrize(("error", "code"), [
    (InvalidArgumentError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
    (ModelNotFoundError("Request for unknown model: 'x' is not found"), grpc.StatusCode.NOT_FOUND),
    (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
])
async def test_errors_map_through_the_status_table(error: Exception, code: grpc.StatusCode) -> None:
    service = GRPCInferenceService(FailingServer(error))  # type: ignore[arg-type]
    context = FakeContext()
    with pytest.raises(Aborted):
        await service.ModelMetadata(pb.ModelMetadataRequest(name="x"), context)
    assert context.code == code
    assert str(error) in context.details


async def test_stream_answers_a_failed_request_and_goes_on() -> None:
    missing = ModelNotFoundError("Request for unknown model: 'x'")
    service = GRPCInferenceService(FailingServer(missing))  # type: ignore[arg-type]

    async def requests() -> AsyncIterator[pb.ModelInferRequest]:
        for i in range(3):
            yield pb.ModelInferRequest(model_name="x", id=str(i))

    replies = [reply async for reply in service.ModelStreamInfer(requests(), FakeContext())]
    assert [r.error_message for r in replies] == ["Request for unknown model: 'x'"] * 3


async def test_stream_aborts_when_reading_the_stream_fails() -> None:
    service = GRPCInferenceService(FailingServer(UnavailableError("unused")))  # type: ignore[arg-type]

    async def requests() -> AsyncIterator[pb.ModelInferRequest]:
        yield pb.ModelInferRequest(model_name="x")
        raise RuntimeError("the transport broke")

    context = FakeContext()
    replies: list[pb.ModelStreamInferResponse] = []
    with pytest.raises(Aborted):
        async for reply in service.ModelStreamInfer(requests(), context):
            replies.append(reply)
    assert len(replies) == 1  # answers before the failure still go out
    assert context.code == grpc.StatusCode.INTERNAL
    assert "the transport broke" in context.details


async def test_answer_in_order_runs_concurrently_and_keeps_the_arrival_order() -> None:
    running = peak = 0

    async def requests() -> AsyncIterator[int]:
        for i in range(10):
            yield i

    async def answer(i: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.001 * (10 - i))  # later requests finish first
        running -= 1
        return i

    assert [x async for x in answer_in_order(requests(), answer, window=4)] == list(range(10))
    assert 1 < peak <= 4
