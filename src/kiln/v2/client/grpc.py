"""The V2 gRPC client (``inference.GRPCInferenceService``), blocking and asyncio, over one channel each.

Tensors go in ``raw_input_contents`` and come back as arrays over the response's bytes; error statuses raise the
typed error they stand for (:mod:`kiln.v2.status`), an unreachable server :class:`ServerUnreachableError`.
Needs grpcio (``kiln[server]``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import grpc.aio
import numpy.typing as npt

from kiln.errors import KilnError
from kiln.tensor import DataType
from kiln.v2 import grpc_codec
from kiln.v2._generated import grpc_service_pb2 as pb
from kiln.v2._generated import grpc_service_pb2_grpc as pb_grpc
from kiln.v2.client.http import ServerUnreachableError
from kiln.v2.status import error_from_grpc
from kiln.v2.types import InferResponse

# Triton's clients lift gRPC's 4 MiB default; a batch of images is larger than that.
_UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def _error(exc: grpc.RpcError) -> KilnError:
    # Sync errors are grpc.Call objects and aio errors AioRpcError: both have code() and details().
    code: grpc.StatusCode | None = exc.code() if hasattr(exc, "code") else None
    message = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.UNAVAILABLE:
        return ServerUnreachableError(f"gRPC: {message}")
    return error_from_grpc(code.name if code is not None else "UNKNOWN", f"gRPC {code}: {message}")


def _infer_request(model: str, inputs: Mapping[str, npt.NDArray[Any]], version: str, outputs: Sequence[str],
                   datatypes: Mapping[str, DataType] | None, parameters: Mapping[str, object] | None,
                   request_id: str) -> pb.ModelInferRequest:
    return grpc_codec.encode_request(model, inputs, version=version, datatypes=datatypes, outputs=outputs,
                                     parameters=parameters, request_id=request_id)


class GrpcClient:
    """A blocking client of the server at ``host:port``."""

    def __init__(self, url: str, *, timeout_s: float | None = 60.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(url, options=_UNLIMITED)
        self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)  # type: ignore[no-untyped-call]

    def infer(self, model: str, inputs: Mapping[str, npt.NDArray[Any]], *, version: str = "",
              outputs: Sequence[str] = (), datatypes: Mapping[str, DataType] | None = None,
              parameters: Mapping[str, object] | None = None, request_id: str = "") -> InferResponse:
        request = _infer_request(model, inputs, version, outputs, datatypes, parameters, request_id)
        return grpc_codec.decode_response(self._call(self._stub.ModelInfer, request))

    def ready(self) -> bool:
        return bool(self._call(self._stub.ServerReady, pb.ServerReadyRequest()).ready)

    def model_ready(self, model: str, version: str = "") -> bool:
        return bool(self._call(self._stub.ModelReady, pb.ModelReadyRequest(name=model, version=version)).ready)

    def model_metadata(self, model: str, version: str = "") -> pb.ModelMetadataResponse:
        response: pb.ModelMetadataResponse = self._call(self._stub.ModelMetadata,
                                                        pb.ModelMetadataRequest(name=model, version=version))
        return response

    def statistics(self, model: str = "", version: str = "") -> pb.ModelStatisticsResponse:
        response: pb.ModelStatisticsResponse = self._call(self._stub.ModelStatistics,
                                                          pb.ModelStatisticsRequest(name=model, version=version))
        return response

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GrpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGrpcClient:
    """The asyncio twin of :class:`GrpcClient` (a ``grpc.aio`` channel: create it inside the event loop)."""

    def __init__(self, url: str, *, timeout_s: float | None = 60.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._channel = grpc.aio.insecure_channel(url, options=_UNLIMITED)
        self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)  # type: ignore[no-untyped-call]

    async def infer(self, model: str, inputs: Mapping[str, npt.NDArray[Any]], *, version: str = "",
                    outputs: Sequence[str] = (), datatypes: Mapping[str, DataType] | None = None,
                    parameters: Mapping[str, object] | None = None, request_id: str = "") -> InferResponse:
        request = _infer_request(model, inputs, version, outputs, datatypes, parameters, request_id)
        return grpc_codec.decode_response(await self._call(self._stub.ModelInfer, request))

    async def ready(self) -> bool:
        return bool((await self._call(self._stub.ServerReady, pb.ServerReadyRequest())).ready)

    async def model_ready(self, model: str, version: str = "") -> bool:
        return bool((await self._call(self._stub.ModelReady, pb.ModelReadyRequest(name=model, version=version))
                     ).ready)

    async def model_metadata(self, model: str, version: str = "") -> pb.ModelMetadataResponse:
        response: pb.ModelMetadataResponse = await self._call(self._stub.ModelMetadata,
                                                              pb.ModelMetadataRequest(name=model, version=version))
        return response

    async def statistics(self, model: str = "", version: str = "") -> pb.ModelStatisticsResponse:
        response: pb.ModelStatisticsResponse = await self._call(
            self._stub.ModelStatistics, pb.ModelStatisticsRequest(name=model, version=version))
        return response

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncGrpcClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
