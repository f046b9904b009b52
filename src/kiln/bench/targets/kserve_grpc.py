"""The grpc target: ``inference.GRPCInferenceService`` over grpc.aio with kiln's generated protos, against kiln or
any KServe V2 / Triton gRPC server. Every slot shares one channel (HTTP/2 multiplexes the calls).

Client send is marshalling the ModelInferRequest (inputs in ``raw_input_contents``); client recv is unmarshalling
the response and its outputs into arrays: perf_analyzer's "(un)marshal" split. The call itself is response wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import grpc

from kiln.bench.data import ModelInputs, Request
from kiln.bench.options import BenchOptions
from kiln.bench.records import ClientTimes
from kiln.bench.server_stats import PHASES, Duration, ServerCounters, add_counters
from kiln.bench.targets.base import REQUEST_TIMEOUT_S
from kiln.bench.targets.remote import RemoteTarget
from kiln.config.spec import TensorSpec
from kiln.errors import InvalidArgumentError, UnavailableError
from kiln.serve_process import KilnProcess
from kiln.tensor import DataType
from kiln.v2 import grpc_codec
from kiln.v2._generated import grpc_service_pb2 as pb

SERVICE = "/inference.GRPCInferenceService/"
CONNECT_TIMEOUT_S = 30.0
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


class GrpcTarget(RemoteTarget):
    kind = "grpc"
    default_port = 8001

    def __init__(self, options: BenchOptions) -> None:
        super().__init__(options)
        self._channel: grpc.aio.Channel | None = None
        self._metadata: Any = None
        self._config: Any = None
        self._stats: Any = None
        self._infer: Any = None
        self._datatypes: dict[str, DataType] = {}

    def served_url(self, process: KilnProcess) -> str:
        return process.grpc_url

    async def aopen(self) -> ModelInputs:
        await _reachable(self.host, self.port)
        self._channel = grpc.aio.insecure_channel(f"{self.host}:{self.port}", options=_CHANNEL_OPTIONS)
        try:
            await asyncio.wait_for(self._channel.channel_ready(), CONNECT_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise UnavailableError(f"no gRPC server answered at {self.host}:{self.port} within "
                                   f"{CONNECT_TIMEOUT_S:.0f} s") from None
        channel = self._channel
        self._metadata = _method(channel, "ModelMetadata", pb.ModelMetadataRequest, pb.ModelMetadataResponse)
        self._config = _method(channel, "ModelConfig", pb.ModelConfigRequest, pb.ModelConfigResponse)
        self._stats = _method(channel, "ModelStatistics", pb.ModelStatisticsRequest, pb.ModelStatisticsResponse)
        self._infer = channel.unary_unary(SERVICE + "ModelInfer")  # bytes in and out: marshalling is timed here
        metadata = await self._metadata(pb.ModelMetadataRequest(name=self.model, version=self.version),
                                        timeout=REQUEST_TIMEOUT_S)
        try:
            config = await self._config(pb.ModelConfigRequest(name=self.model, version=self.version),
                                        timeout=REQUEST_TIMEOUT_S)
            max_batch_size = int(config.config.max_batch_size)
        except grpc.aio.AioRpcError:  # a V2 server without Triton's ModelConfig: treat as not batching
            max_batch_size = 0
        inputs = tuple(_tensor(self.model, t, max_batch_size > 0) for t in metadata.inputs)
        self._datatypes = {t.name: t.datatype for t in inputs}
        return ModelInputs(self.model, inputs, max_batch_size)

    async def ainfer(self, slot: int, request: Request) -> ClientTimes | None:
        start = time.monotonic_ns()
        message = grpc_codec.encode_request(self.model, request, version=self.version,
                                            datatypes=self._datatypes).SerializeToString()
        sent = time.monotonic_ns()
        data = await self._infer(message, timeout=REQUEST_TIMEOUT_S)
        received = time.monotonic_ns()
        grpc_codec.decode_response(pb.ModelInferResponse.FromString(data))
        return ClientTimes(sent - start, time.monotonic_ns() - received)

    async def astats(self) -> ServerCounters | None:
        try:
            response = await self._stats(
                pb.ModelStatisticsRequest(name=self.model, version=self.version), timeout=REQUEST_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # no statistics extension: no breakdown
                return None
            raise
        return add_counters(_counters(s) for s in response.model_stats if s.name == self.model)

    async def aclose(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()


async def _reachable(host: str, port: int) -> None:
    """Fail at once when nothing listens (a gRPC channel would keep retrying until its deadline)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError) as exc:
        raise UnavailableError(f"no gRPC server at {host}:{port}: {exc}") from None
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


def _method(channel: Any, name: str, request: Any, response: Any) -> Any:
    return channel.unary_unary(SERVICE + name, request_serializer=request.SerializeToString,
                               response_deserializer=response.FromString)


def _counters(stats: pb.ModelStatistics) -> ServerCounters:
    inference = stats.inference_stats
    phases = {name: Duration(getattr(inference, name).count, getattr(inference, name).ns) for name in PHASES}
    return ServerCounters(inference.success.count, phases)


def _tensor(model: str, tensor: pb.ModelMetadataResponse.TensorMetadata, batching: bool) -> TensorSpec:
    shape = [int(d) for d in tensor.shape]
    if batching:
        if not shape:
            raise InvalidArgumentError(f"model '{model}': input '{tensor.name}' has an empty shape although the "
                                       f"model batches")
        shape = shape[1:]
    return TensorSpec(name=tensor.name, datatype=DataType.from_wire(tensor.datatype), dims=tuple(shape))
