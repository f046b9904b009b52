"""Triton's ``inference.GRPCInferenceService`` over the :class:`~kiln.server.server.Server` facade.

Every RPC, unary and streaming, is decorated with :func:`rpc`: the one place where an exception becomes a gRPC
status (``status.as_kiln_error`` + ``status.grpc_code``, then ``context.abort``). A unit test walks the service
descriptor and fails for any RPC that lacks it. In ``ModelStreamInfer`` a failed request is answered with an
``error_message`` and the stream goes on.

``ModelStreamInfer`` answers requests as they come, several at once: a decoupled model's responses go out as the
model sends them (so several requests' responses interleave), other models' answers in the order their requests
came. A request with the parameter ``triton_enable_empty_final_response: true`` gets ``triton_final_response``
(true on its last one) on each of its responses, and a response with no outputs when the model ends it with the
final flag alone; without it that flag-only response is not sent. ``ModelInfer`` refuses decoupled models in
Triton's words.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, NoReturn, TypeAlias, TypeVar, cast

import grpc

from kiln.errors import InvalidArgumentError, UnsupportedError
from kiln.server.server import DecoupledModelError, Server, StreamItem
from kiln.server.stats import Duration, ModelStats, ResponseStats
from kiln.v2 import grpc_codec as codec
from kiln.v2 import status
from kiln.v2._generated import grpc_service_pb2 as pb

Context: TypeAlias = Any
"""A ``grpc.aio.ServicerContext`` (grpcio ships no type information)."""
F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")
T = TypeVar("T")

WRAPPED_MARK = "__kiln_grpc_rpc__"
"""Attribute that :func:`rpc` sets on every method it wraps (checked by the tests)."""

RAW_REQUEST_METHODS = frozenset({"ModelInfer", "ModelStreamInfer"})
"""RPCs whose requests the servicer takes as bytes and parses itself: bytes that are no request are then the
client's error (INVALID_ARGUMENT, or one error_message in a stream), not grpc's UNKNOWN from its deserializer."""

STREAM_WINDOW = 64
"""ModelStreamInfer runs up to this many requests of one stream at once; answers still go out in order."""

EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"
FINAL_RESPONSE = "triton_final_response"
"""Triton's request parameter asking for the final-response flag, and the response parameter carrying it."""


# -- the one error wrapper ---------------------------------------------------------------------------------------


def error_message(exc: BaseException) -> str:
    """The message a client sees for ``exc`` (unexpected exceptions are logged and reported as internal)."""
    return status.as_kiln_error(exc).message


async def abort_with(context: Context, exc: Exception) -> NoReturn:
    """Abort the call with the status and message :mod:`kiln.v2.status` gives ``exc``. Call it outside the
    ``except`` block that caught ``exc`` (see :func:`rpc`)."""
    if isinstance(exc, grpc.aio.AbortError):  # the RPC is already aborted: keep its status
        raise exc
    error = status.as_kiln_error(exc)
    await context.abort(status.grpc_code(error), error.message)
    raise AssertionError("context.abort() returned")  # pragma: no cover - grpc.aio's abort always raises


def _detached(exc: Exception) -> Exception:
    """``exc`` without its traceback. The frames it lists hold the request (a ModelInfer's input bytes): kept
    alive as the abort's context, they would stay in memory until the garbage collector's next full pass."""
    if isinstance(exc, grpc.aio.AbortError):  # already aborted: abort_with re-raises it
        return cast(Exception, exc)
    error = status.as_kiln_error(exc)
    error.__traceback__ = error.__context__ = error.__cause__ = None  # each chained one has its frames too
    return error


def rpc(method: F) -> F:
    """Wrap one servicer method (a coroutine, or an async generator for streaming responses) so that any
    exception aborts the call with the status from :mod:`kiln.v2.status`."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def streaming(self: Any, requests: Any, context: Context) -> AsyncIterator[Any]:
            failure: Exception | None = None
            try:
                async for response in method(self, requests, context):
                    yield response
            except Exception as exc:
                failure = _detached(exc)
            if failure is not None:  # aborted here, not in the except block: see _detached
                await abort_with(context, failure)

        wrapped: Callable[..., Any] = streaming
    else:

        @functools.wraps(method)
        async def unary(self: Any, request: Any, context: Context) -> Any:
            try:
                return await method(self, request, context)
            except Exception as exc:
                failure = _detached(exc)
            # The abort's exception lists this frame, and grpc keeps it until the collector's next full pass: the
            # request (up to --grpc-max-message-size bytes) must not be held there.
            del request
            await abort_with(context, failure)  # not in the except block: see _detached

        wrapped = unary
    setattr(wrapped, WRAPPED_MARK, True)
    return cast(F, wrapped)


def is_wrapped(method: object) -> bool:
    return getattr(method, WRAPPED_MARK, False) is True


# -- the service -------------------------------------------------------------------------------------------------


class GRPCInferenceService:
    """Servicer for :func:`kiln.frontends.grpc.server.method_handlers`; method names are the RPC names."""

    def __init__(self, server: Server) -> None:
        self._server = server

    @rpc
    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self._server.live())

    @rpc
    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._server.ready())

    @rpc
    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=self._server.model_ready(request.name, request.version))

    @rpc
    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Context) -> pb.ServerMetadataResponse:
        metadata = self._server.metadata()
        extensions = cast("list[str]", metadata["extensions"])
        return pb.ServerMetadataResponse(name=str(metadata["name"]), version=str(metadata["version"]),
                                         extensions=extensions)

    @rpc
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Context) -> pb.ModelMetadataResponse:
        metadata = self._server.model_metadata(request.name, request.version)
        batch = (-1,) if metadata.batching else ()
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=metadata.name,
            versions=metadata.versions,
            platform=metadata.platform,
            inputs=[tensor(name=t.name, datatype=t.datatype.wire_name, shape=batch + t.dims) for t in metadata.inputs],
            outputs=[tensor(name=t.name, datatype=t.datatype.wire_name, shape=batch + t.dims)
                     for t in metadata.outputs],
        )

    @rpc
    async def ModelInfer(self, request: pb.ModelInferRequest | bytes, context: Context) -> pb.ModelInferResponse:
        try:
            decoded = codec.decode_serialized(request) if isinstance(request, bytes) else codec.decode_request(request)
        except codec.RefusedRequest as exc:  # an unknown model is NOT_FOUND whatever else is wrong, as in Triton
            self._server.model_metadata(exc.model, exc.version)
            raise
        except InvalidArgumentError:
            if not isinstance(request, bytes):
                self._server.model_metadata(request.model_name, request.model_version)
            raise
        del request  # the decoded request holds what it needs of it
        try:
            return codec.encode_response(await self._server.infer(decoded))
        except DecoupledModelError as exc:
            raise model_infer_error(exc) from None

    @rpc
    async def ModelStreamInfer(self, requests: AsyncIterator[pb.ModelInferRequest | bytes],
                               context: Context) -> AsyncIterator[pb.ModelStreamInferResponse]:
        async for reply in answer_streams(_parsed(requests), self._stream_replies, self._in_order, STREAM_WINDOW):
            yield reply

    def _in_order(self, request: pb.ModelInferRequest | InvalidArgumentError) -> bool:
        if isinstance(request, InvalidArgumentError):
            return True
        try:
            return not self._server.model_is_decoupled(request.model_name, request.model_version)
        except Exception:  # the request itself will say what is wrong; reading the stream goes on
            return True

    async def _stream_replies(self, request: pb.ModelInferRequest | InvalidArgumentError,
                              ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        if isinstance(request, InvalidArgumentError):  # bytes that are no request: answered, the stream goes on
            yield _error_reply(pb.ModelInferRequest(), request.message, False, True, "")
            return
        flagged = False
        try:
            flagged = _wants_final_flag(request)
            async for item in self._server.infer_stream(codec.decode_request(request)):
                reply = _stream_reply(item, request, flagged)
                if reply is not None:
                    yield reply
        except Exception as exc:  # this request failed; the stream goes on
            yield _error_reply(request, error_message(exc), flagged, True, request.model_version)

    @rpc
    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Context) -> pb.ModelConfigResponse:
        return pb.ModelConfigResponse(config=self._server.model_config(request.name, request.version))

    @rpc
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest,
                              context: Context) -> pb.ModelStatisticsResponse:
        stats = self._server.model_statistics(request.name, request.version)
        return pb.ModelStatisticsResponse(model_stats=[_statistics(s) for s in stats])

    @rpc
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest,
                              context: Context) -> pb.RepositoryIndexResponse:
        _check_repository_name(request.repository_name)
        index = pb.RepositoryIndexResponse.ModelIndex
        entries = self._server.repository_index(ready_only=request.ready)
        return pb.RepositoryIndexResponse(models=[index(name=e.name, version=e.version, state=e.state,
                                                        reason=e.reason) for e in entries])

    @rpc
    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest,
                                  context: Context) -> pb.RepositoryModelLoadResponse:
        _check_repository_name(request.repository_name)
        config, files = _load_parameters(request.model_name, request.parameters)
        await asyncio.to_thread(self._server.load_model, request.model_name, config, files)
        return pb.RepositoryModelLoadResponse()

    @rpc
    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest,
                                    context: Context) -> pb.RepositoryModelUnloadResponse:
        _check_repository_name(request.repository_name)
        dependents = request.parameters.get("unload_dependents")
        unload_dependents = dependents is not None and dependents.WhichOneof("parameter_choice") == "bool_param" \
            and dependents.bool_param
        await asyncio.to_thread(self._server.unload_model, request.model_name, unload_dependents)
        return pb.RepositoryModelUnloadResponse()

    @rpc
    async def SystemSharedMemoryStatus(self, request: pb.SystemSharedMemoryStatusRequest,
                                       context: Context) -> pb.SystemSharedMemoryStatusResponse:
        region = pb.SystemSharedMemoryStatusResponse.RegionStatus
        return pb.SystemSharedMemoryStatusResponse(regions={
            s.name: region(name=s.name, key=s.key, offset=s.offset, byte_size=s.byte_size)
            for s in self._server.system_shared_memory_status(request.name)})

    @rpc
    async def SystemSharedMemoryRegister(self, request: pb.SystemSharedMemoryRegisterRequest,
                                         context: Context) -> pb.SystemSharedMemoryRegisterResponse:
        self._server.register_system_shared_memory(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @rpc
    async def SystemSharedMemoryUnregister(self, request: pb.SystemSharedMemoryUnregisterRequest,
                                           context: Context) -> pb.SystemSharedMemoryUnregisterResponse:
        await asyncio.to_thread(self._server.unregister_system_shared_memory, request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @rpc
    async def CudaSharedMemoryStatus(self, request: pb.CudaSharedMemoryStatusRequest,
                                     context: Context) -> pb.CudaSharedMemoryStatusResponse:
        region = pb.CudaSharedMemoryStatusResponse.RegionStatus
        return pb.CudaSharedMemoryStatusResponse(regions={
            s.name: region(name=s.name, device_id=s.device_id, byte_size=s.byte_size)
            for s in self._server.cuda_shared_memory_status(request.name)})

    @rpc
    async def CudaSharedMemoryRegister(self, request: pb.CudaSharedMemoryRegisterRequest,
                                       context: Context) -> pb.CudaSharedMemoryRegisterResponse:
        await asyncio.to_thread(self._server.register_cuda_shared_memory, request.name, request.raw_handle,
                                request.device_id, request.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    @rpc
    async def CudaSharedMemoryUnregister(self, request: pb.CudaSharedMemoryUnregisterRequest,
                                         context: Context) -> pb.CudaSharedMemoryUnregisterResponse:
        await asyncio.to_thread(self._server.unregister_cuda_shared_memory, request.name)
        return pb.CudaSharedMemoryUnregisterResponse()

    @rpc
    async def TraceSetting(self, request: pb.TraceSettingRequest, context: Context) -> pb.TraceSettingResponse:
        raise UnsupportedError("trace settings are not supported by kiln's gRPC endpoint (kiln has no request "
                               "tracing); use ModelStatistics or the Prometheus metrics for timings")

    @rpc
    async def LogSettings(self, request: pb.LogSettingsRequest, context: Context) -> pb.LogSettingsResponse:
        raise UnsupportedError("log settings are not supported by kiln's gRPC endpoint; set logging when starting "
                               "the server (`kiln serve --log-verbose N --log-format ...`)")


# -- helpers -----------------------------------------------------------------------------------------------------


def model_infer_error(exc: Exception) -> Exception:
    """The error ModelInfer reports for ``exc``: Triton's words for a decoupled model, else ``exc`` itself (the
    gRPC workers' server side reports through this too)."""
    if isinstance(exc, DecoupledModelError):
        return UnsupportedError("ModelInfer RPC doesn't support models with decoupled transaction policy")
    return exc


async def _parsed(requests: AsyncIterator[pb.ModelInferRequest | bytes],
                  ) -> AsyncIterator[pb.ModelInferRequest | InvalidArgumentError]:
    """A stream's requests, parsed here when they come as bytes; one that does not parse becomes its error."""
    async for request in requests:
        if not isinstance(request, bytes):
            yield request
            continue
        try:
            yield codec.parse_request(request)
        except InvalidArgumentError as exc:
            yield exc


def _wants_final_flag(request: pb.ModelInferRequest) -> bool:
    value = request.parameters.get(EMPTY_FINAL_RESPONSE)
    if value is None:
        return False
    if value.WhichOneof("parameter_choice") != "bool_param":
        raise InvalidArgumentError(f"invalid value type for '{EMPTY_FINAL_RESPONSE}' parameter, expected bool_param.")
    return bool(value.bool_param)


def _stream_reply(item: StreamItem, request: pb.ModelInferRequest,
                  flagged: bool) -> pb.ModelStreamInferResponse | None:
    """One streamed answer as a stream response; None for a final flag alone that the client did not ask for."""
    if item.error is not None:
        return _error_reply(request, error_message(item.error), flagged, item.final, item.model_version)
    reply = pb.ModelStreamInferResponse()
    answer = reply.infer_response
    if item.response is not None:
        codec.encode_response(item.response, answer)
    elif not flagged:
        return None
    else:
        answer.model_name, answer.model_version, answer.id = request.model_name, item.model_version, request.id
    if flagged:
        answer.parameters[FINAL_RESPONSE].bool_param = item.final
    return reply


def _error_reply(request: pb.ModelInferRequest, message: str, flagged: bool, final: bool,
                 version: str) -> pb.ModelStreamInferResponse:
    """A failed answer; it names the request (id) so that a client with several in flight knows which failed."""
    reply = pb.ModelStreamInferResponse(error_message=message)
    answer = reply.infer_response
    answer.model_name, answer.model_version, answer.id = request.model_name, version, request.id
    if flagged:
        answer.parameters[FINAL_RESPONSE].bool_param = final
    return reply


async def answer_streams(requests: AsyncIterator[R], answer: Callable[[R], AsyncIterator[T]],
                         in_order: Callable[[R], bool], window: int) -> AsyncIterator[T]:
    """Start answering each request as it arrives, up to ``window`` at once, and yield the answers: those of a
    request for which ``in_order`` is true after the answers of every such request that came before it, the
    others as they come. ``answer`` must not raise (a stream answers a failed request with a message); a failure
    to read ``requests`` is raised once the answers already started have been yielded."""
    out: asyncio.Queue[T | _End] = asyncio.Queue()
    slots = asyncio.Semaphore(window)
    running: set[asyncio.Task[None]] = set()

    async def pump(request: R, after: asyncio.Event | None, done: asyncio.Event | None) -> None:
        try:
            if after is None:
                async for reply in answer(request):
                    out.put_nowait(reply)
                return
            replies = [reply async for reply in answer(request)]
            await after.wait()
            for reply in replies:
                out.put_nowait(reply)
        finally:
            if done is not None:
                done.set()
            slots.release()

    async def read() -> None:
        previous = asyncio.Event()
        previous.set()
        try:
            async for request in requests:
                await slots.acquire()
                if in_order(request):
                    done = asyncio.Event()
                    task = asyncio.create_task(pump(request, previous, done))
                    previous = done
                else:
                    task = asyncio.create_task(pump(request, None, None))
                running.add(task)
                task.add_done_callback(running.discard)
        finally:
            if running:
                await asyncio.wait(list(running))
            out.put_nowait(_END)

    reader = asyncio.create_task(read())
    try:
        while not isinstance(item := await out.get(), _End):
            yield item
        await reader
    finally:
        for task in list(running):
            task.cancel()
        reader.cancel()
        if reader.done() and not reader.cancelled():
            reader.exception()  # retrieved: a read failure seen while cancelling is not logged as lost


class _End:
    """The end of :func:`answer_streams`' output."""


_END = _End()


async def answer_in_order(requests: AsyncIterator[R], answer: Callable[[R], Awaitable[T]],
                          window: int) -> AsyncIterator[T]:
    """:func:`answer_streams` for requests with one answer each, all in arrival order."""

    async def one(request: R) -> AsyncIterator[T]:
        yield await answer(request)

    async for reply in answer_streams(requests, one, lambda request: True, window):
        yield reply


def _check_repository_name(name: str) -> None:
    if name:
        raise UnsupportedError(f"'repository_name' specification is not supported (got '{name}'); leave it empty "
                               f"to address every repository")


def _duration(duration: Duration) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=duration.count, ns=duration.ns)


def _statistics(stats: ModelStats) -> pb.ModelStatistics:
    return pb.ModelStatistics(
        name=stats.name,
        version=stats.version,
        last_inference=stats.last_inference_ms,
        inference_count=stats.inference_count,
        execution_count=stats.execution_count,
        inference_stats=pb.InferStatistics(
            success=_duration(stats.success),
            fail=_duration(stats.fail),
            queue=_duration(stats.queue),
            compute_input=_duration(stats.compute_input),
            compute_infer=_duration(stats.compute_infer),
            compute_output=_duration(stats.compute_output),
            cache_hit=pb.StatisticDuration(),
            cache_miss=pb.StatisticDuration(),
        ),
        batch_stats=[
            pb.InferBatchStatistics(batch_size=batch.batch_size, compute_input=_duration(batch.compute_input),
                                    compute_infer=_duration(batch.compute_infer),
                                    compute_output=_duration(batch.compute_output))
            for _, batch in sorted(stats.batch_stats.items())
        ],
        response_stats={key: _response_statistics(entry) for key, entry in stats.response_stats.items()},
    )


def _response_statistics(entry: ResponseStats) -> pb.InferResponseStatistics:
    return pb.InferResponseStatistics(
        compute_infer=_duration(entry.compute_infer), compute_output=_duration(entry.compute_output),
        success=_duration(entry.success), fail=_duration(entry.fail),
        empty_response=_duration(entry.empty_response), cancel=_duration(entry.cancel))


def _load_parameters(model: str, parameters: Mapping[str, pb.ModelRepositoryParameter]) -> tuple[str | None,
                                                                                                  dict[str, bytes]]:
    """``config`` (string_param, ModelConfig JSON) and ``file:<version>/<name>`` (bytes_param) of a load."""
    config: str | None = None
    files: dict[str, bytes] = {}
    for key, value in parameters.items():
        kind = value.WhichOneof("parameter_choice")
        if key == "config" and kind == "string_param":
            config = value.string_param
        elif key.startswith("file:") and kind == "bytes_param":
            files[key] = value.bytes_param
        else:
            raise InvalidArgumentError(f"load of model '{model}': parameter '{key}' ({kind}) is not understood; "
                                       f"expected 'config' (string) or 'file:<version>/<name>' (bytes)")
    return config, files
