"""ModelInferRequest <-> :class:`~kiln.v2.types.InferRequest` and ModelInferResponse <-> InferResponse: the
server side decodes requests and encodes responses, the client side (:func:`encode_request`,
:func:`decode_response`) the opposite.

Request data arrives either in ``raw_input_contents`` (one little-endian, row-major buffer per input, in ``inputs``
order; required for FP16/BF16) or in each input's typed ``contents`` field, never both. Raw buffers become
``numpy.frombuffer`` views (no copy); BYTES buffers are length-prefixed and parsed by
:func:`kiln.tensor.decode_bytes`; typed contents take one ``numpy.asarray`` per tensor. Responses always carry
their data in ``raw_output_contents``, as Triton's do, BYTES length-prefixed.

Every problem with a request is an :class:`~kiln.errors.InvalidArgumentError` naming the model and the input.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.errors import InternalError, InvalidArgumentError
from kiln.tensor import MAX_SHAPE_ELEMENTS, DataType, decode_bytes, element_count, shape_fits
from kiln.v2._generated import grpc_service_pb2 as pb
from kiln.v2.layout import from_raw, to_raw
from kiln.v2.types import (
    InferRequest,
    InferResponse,
    InputTensor,
    OutputTensor,
    RequestedOutput,
    SharedMemoryRef,
    shared_memory_ref,
)

ParameterValue = bool | int | float | str
Buffer = bytes | memoryview

CLASSIFICATION = "classification"
"""The per-output parameter (int64) asking for the top-k classes instead of the tensor."""

_INT64_MAX = 2**63 - 1
_DATATYPES: dict[str, DataType] = {t.wire_name: t for t in DataType}
_CONTENTS_FIELD: dict[DataType, str] = {
    DataType.BOOL: "bool_contents",
    DataType.INT8: "int_contents",
    DataType.INT16: "int_contents",
    DataType.INT32: "int_contents",
    DataType.INT64: "int64_contents",
    DataType.UINT8: "uint_contents",
    DataType.UINT16: "uint_contents",
    DataType.UINT32: "uint_contents",
    DataType.UINT64: "uint64_contents",
    DataType.FP32: "fp32_contents",
    DataType.FP64: "fp64_contents",
    DataType.BYTES: "bytes_contents",
}
"""The typed ``InferTensorContents`` field of each datatype; FP16 and BF16 have none (raw only)."""

InputMessage = pb.ModelInferRequest.InferInputTensor


# -- requests ----------------------------------------------------------------------------------------------------


class RefusedRequest(InvalidArgumentError):
    """A serialized request refused before it was parsed whole; names the model it is for."""

    def __init__(self, message: str, model: str, version: str) -> None:
        super().__init__(message)
        self.model = model
        self.version = version


PRECHECK_BYTES = 1 << 20
"""Serialized requests from this size on have their raw_input_contents sizes checked before they are parsed."""
_RAW_FIELD = pb.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number


def parse_request(payload: bytes) -> pb.ModelInferRequest:
    """A serialized ModelInferRequest; bytes that are none are the client's error, in one line. A large one whose
    raw_input_contents do not have the sizes its inputs declare is refused (:class:`RefusedRequest`) before it is
    parsed, which would hold its tensor bytes twice more."""
    if len(payload) >= PRECHECK_BYTES:
        _check_raw_sizes(payload)
    try:
        return pb.ModelInferRequest.FromString(payload)
    except Exception as exc:  # protobuf's DecodeError (its class differs between protobuf's implementations)
        raise InvalidArgumentError(f"could not parse the ModelInfer request ({len(payload)} bytes): {exc}") from None


def _check_raw_sizes(payload: bytes) -> None:
    """Parse every field but raw_input_contents, whose entries are only measured, and refuse sizes that cannot
    be right (a wrong entry count, a fixed-size input with a wrong byte size). Anything unusual is left to the
    full parse, which reports it."""
    split = _raw_apart(payload)
    if split is None or not split[1]:
        return
    head, raw = split
    raw_sizes = [len(entry) for entry in raw]
    try:
        message = pb.ModelInferRequest.FromString(head)
    except Exception:  # the full parse reports it
        return
    model = message.model_name
    try:
        refusal = _raw_size_refusal(model, message.inputs[:], raw_sizes)
    except InvalidArgumentError:  # a bad input header: the full decode reports it
        return
    if refusal is not None:  # raised here, not in an except block: nothing chains this frame, which holds payload
        raise RefusedRequest(refusal.message, model, message.model_version)


def _raw_size_refusal(model: str, inputs: list[InputMessage], raw_sizes: list[int]) -> InvalidArgumentError | None:
    plain = [tensor for tensor in inputs if _shared_memory(model, tensor) is None]
    if len(raw_sizes) != len(plain):
        return _raw_count_error(model, len(plain), len(raw_sizes))
    for tensor, size in zip(plain, raw_sizes, strict=True):
        datatype, shape = _header(model, tensor)
        if datatype is not DataType.BYTES and size != element_count(shape) * datatype.numpy_dtype.itemsize:
            return _raw_size_error(model, tensor.name, datatype, shape, size)
    return None


def decode_serialized(payload: bytes) -> InferRequest:
    """:func:`decode_request` of the serialized request as it came, its raw_input_contents views of ``payload``:
    only the rest of the message is parsed, so an input's bytes are not copied twice more (by the parse and by
    reading the field). Where its top level does not read plainly, the whole message is parsed as
    :func:`parse_request` does. A request that parses but does not decode is refused with the model it names
    (:class:`RefusedRequest`), so the caller can say first whether that model exists."""
    split = _raw_apart(payload)
    raw: list[memoryview] | None = None
    if split is None:
        message = parse_request(payload)
    else:
        head, raw = split
        try:
            message = pb.ModelInferRequest.FromString(head)
        except Exception as exc:  # protobuf's DecodeError, as in parse_request
            raise InvalidArgumentError(f"could not parse the ModelInfer request ({len(payload)} bytes): "
                                       f"{exc}") from None
    try:
        return decode_request(message, raw)
    except InvalidArgumentError as exc:
        reason = exc.message
    # Raised outside the except block, and bound to no name here: the refusal chains nothing, and no cycle
    # through this frame keeps ``payload`` (up to --grpc-max-message-size bytes) until the collector runs.
    raise RefusedRequest(reason, message.model_name, message.model_version)


def _raw_apart(payload: bytes) -> tuple[bytes, list[memoryview]] | None:
    """The serialized message without its raw_input_contents, and those entries as views of ``payload``; None
    where the top level does not read plainly (see :func:`_top_level_fields`) or an entry is not length-delimited,
    as a bytes field is."""
    view = memoryview(payload)
    fields = _top_level_fields(view)
    if fields is None or any(wire_type != 2 for number, wire_type, *_ in fields if number == _RAW_FIELD):
        return None
    head = b"".join(view[start:end] for number, _, start, _, end in fields if number != _RAW_FIELD)
    return head, [view[value:end] for number, _, _, value, end in fields if number == _RAW_FIELD]


def _top_level_fields(data: memoryview) -> list[tuple[int, int, int, int, int]] | None:
    """(field number, wire type, start of its tag, start of its value, end) of each top-level field of a serialized
    message; None for anything but varint, fixed and length-delimited fields, or a truncated one."""
    fields = []
    at, end = 0, len(data)
    while at < end:
        start = at
        key, at = _varint(data, at)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, at = _varint(data, at)
            value = at
        elif wire_type == 2:
            length, value = _varint(data, at)
            at = value + length
        elif wire_type in (1, 5):
            value = at
            at += 8 if wire_type == 1 else 4
        else:
            return None
        if at > end or value > end:
            return None
        fields.append((number, wire_type, start, value, at))
    return fields


def _varint(data: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while at < len(data) and shift < 64:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
    return value, len(data) + 1  # truncated: past the end, which the caller refuses


def _raw_count_error(model: str, plain: int, raw: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"model '{model}': the request has {plain} input(s) but {raw} raw_input_contents entries; "
        f"raw_input_contents needs exactly one entry per input (except inputs in shared memory), in "
        f"'inputs' order"
    )


def _raw_size_error(model: str, name: str, datatype: DataType, shape: tuple[int, ...],
                    size: int) -> InvalidArgumentError:
    itemsize = datatype.numpy_dtype.itemsize
    return InvalidArgumentError(
        f"model '{model}': input '{name}': unexpected total byte size {size} in raw_input_contents, expecting "
        f"{element_count(shape) * itemsize} (shape {list(shape)} x {itemsize}-byte {datatype.wire_name})"
    )


def decode_request(message: pb.ModelInferRequest, raw: Sequence[Buffer] | None = None) -> InferRequest:
    """Build the protocol-free request; tensor data stays a view over the received bytes where possible. ``raw``:
    the raw_input_contents entries where the caller has them apart from ``message`` (:func:`decode_serialized`)."""
    # Repeated fields are read with [:] (one list per field): iterating upb containers directly is several
    # times slower, and this runs for every request.
    model = message.model_name
    tensors = message.inputs[:]
    if raw is None:
        raw = message.raw_input_contents[:]
    shm = [_shared_memory(model, tensor) for tensor in tensors]
    if raw:
        plain = len(tensors) - sum(ref is not None for ref in shm)
        if len(raw) != plain:
            raise _raw_count_error(model, plain, len(raw))
        entries = iter(raw)
        inputs = [_from_raw(model, tensor, next(entries)) if ref is None else _from_shm(model, tensor, ref)
                  for tensor, ref in zip(tensors, shm, strict=True)]
    else:
        inputs = [_from_contents(model, tensor) if ref is None else _from_shm(model, tensor, ref)
                  for tensor, ref in zip(tensors, shm, strict=True)]
    outputs = message.outputs
    parameters = message.parameters
    return InferRequest(
        model_name=model,
        inputs=inputs,
        model_version=message.model_version,
        id=message.id,
        outputs=[_requested_output(model, output) for output in outputs[:]] if outputs else [],
        parameters=decode_parameters(parameters, f"model '{model}': request") if parameters else {},
    )


def _header(model: str, tensor: InputMessage) -> tuple[DataType, tuple[int, ...]]:
    datatype = _DATATYPES.get(tensor.datatype)
    if datatype is None:
        expected = ", ".join(_DATATYPES)
        raise InvalidArgumentError(f"model '{model}': input '{tensor.name}' has unknown datatype "
                                   f"'{tensor.datatype}'; expected one of {expected}")
    shape = tuple(tensor.shape[:])
    if shape and min(shape) < 0:
        raise InvalidArgumentError(f"model '{model}': input '{tensor.name}' has shape {list(shape)}; "
                                   f"dimensions cannot be negative")
    if not shape_fits(shape):
        raise InvalidArgumentError(f"model '{model}': input '{tensor.name}' has shape {list(shape)}, more than "
                                   f"{MAX_SHAPE_ELEMENTS} elements")
    return datatype, shape


def _input_parameters(model: str, tensor: InputMessage) -> dict[str, ParameterValue]:
    if not tensor.parameters:
        return {}
    return decode_parameters(tensor.parameters, f"model '{model}': input '{tensor.name}'")


def _shared_memory(model: str, tensor: InputMessage) -> SharedMemoryRef | None:
    if not tensor.parameters:
        return None
    return shared_memory_ref(_input_parameters(model, tensor), f"model '{model}': input '{tensor.name}'")


def _from_shm(model: str, tensor: InputMessage, ref: SharedMemoryRef) -> InputTensor:
    """An input in a shared-memory region: the Server fills its data from the region."""
    if tensor.HasField("contents"):
        raise InvalidArgumentError(f"model '{model}': input '{tensor.name}' names shared memory region "
                                   f"'{ref.region}' and also sets 'contents'; send its data one way")
    datatype, shape = _header(model, tensor)
    return InputTensor(tensor.name, datatype, shape, np.empty(0, datatype.numpy_dtype),
                       _input_parameters(model, tensor), ref)


def _from_raw(model: str, tensor: InputMessage, data: Buffer) -> InputTensor:
    if tensor.HasField("contents"):
        raise InvalidArgumentError(
            f"model '{model}': input '{tensor.name}' sets 'contents' while the request uses raw_input_contents; "
            f"send every input's data one way: all in raw_input_contents, or all in contents"
        )
    datatype, shape = _header(model, tensor)
    count = element_count(shape)
    array: npt.NDArray[Any]
    if datatype is DataType.BYTES:
        try:
            array = decode_bytes(data, count)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"model '{model}': input '{tensor.name}' (BYTES, shape {list(shape)}): "
                                       f"{exc.message}") from None
    else:
        dtype = datatype.numpy_dtype
        expected = count * dtype.itemsize
        if len(data) != expected:
            raise _raw_size_error(model, tensor.name, datatype, shape, len(data))
        array = np.frombuffer(data, dtype=dtype)
    return InputTensor(tensor.name, datatype, shape, array.reshape(shape), _input_parameters(model, tensor))


def _from_contents(model: str, tensor: InputMessage) -> InputTensor:
    datatype, shape = _header(model, tensor)
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidArgumentError(f"model '{model}': input '{tensor.name}' is {datatype.wire_name}, which has no "
                                   f"typed contents field; send its data in raw_input_contents")
    contents = getattr(tensor.contents, field)
    count = element_count(shape)
    if (given := len(contents)) != count:  # counted in the message: a wrong count never becomes a Python list
        raise InvalidArgumentError(
            f"model '{model}': input '{tensor.name}' has {given} element(s) in contents.{field}; its shape "
            f"{list(shape)} needs {count} ({datatype.wire_name} data goes in contents.{field})"
        )
    values = contents[:]
    array: npt.NDArray[Any]
    if datatype is DataType.BYTES:
        array = np.empty(count, dtype=object)
        array[:] = values
    else:
        try:
            array = np.asarray(values, dtype=datatype.numpy_dtype)
        except (OverflowError, ValueError) as exc:
            raise InvalidArgumentError(f"model '{model}': input '{tensor.name}': contents.{field} holds a value "
                                       f"that does not fit {datatype.wire_name}: {exc}") from None
    return InputTensor(tensor.name, datatype, shape, array.reshape(shape), _input_parameters(model, tensor))


def _requested_output(model: str, output: pb.ModelInferRequest.InferRequestedOutputTensor) -> RequestedOutput:
    if not output.parameters:
        return RequestedOutput(output.name)
    parameters = decode_parameters(output.parameters, f"model '{model}': output '{output.name}'")
    classification = parameters.pop(CLASSIFICATION, 0)
    if isinstance(classification, bool) or not isinstance(classification, int):
        raise InvalidArgumentError(f"model '{model}': output '{output.name}': parameter '{CLASSIFICATION}' is "
                                   f"{classification!r}; expected an integer class count (int64_param)")
    where = f"model '{model}': output '{output.name}'"
    return RequestedOutput(output.name, classification, parameters, shared_memory_ref(parameters, where))


# -- parameters --------------------------------------------------------------------------------------------------


def decode_parameters(parameters: Mapping[str, pb.InferParameter], where: str) -> dict[str, ParameterValue]:
    """InferParameter map -> Python values (bool, int, str, float)."""
    decoded: dict[str, ParameterValue] = {}
    for key, parameter in parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        if choice is None:
            raise InvalidArgumentError(f"{where}: parameter '{key}' has no value; set one of bool_param, "
                                       f"int64_param, string_param, double_param, uint64_param")
        decoded[key] = getattr(parameter, choice)
    return decoded


def encode_parameters(target: MutableMapping[str, pb.InferParameter], parameters: Mapping[str, object]) -> None:
    """Python values -> the InferParameter map ``target`` (an int beyond int64 becomes uint64_param)."""
    for key, value in parameters.items():
        parameter = target[key]
        if isinstance(value, (bool, np.bool_)):
            parameter.bool_param = bool(value)
        elif isinstance(value, (int, np.integer)):
            if int(value) > _INT64_MAX:
                parameter.uint64_param = int(value)
            else:
                parameter.int64_param = int(value)
        elif isinstance(value, (float, np.floating)):
            parameter.double_param = float(value)
        elif isinstance(value, str):
            parameter.string_param = value
        else:
            raise InternalError(f"parameter '{key}' has a value of type {type(value).__name__}, which gRPC "
                                f"InferParameter cannot carry (bool, int, float or str)")


# -- responses ---------------------------------------------------------------------------------------------------


def encode_response(response: InferResponse, message: pb.ModelInferResponse | None = None) -> pb.ModelInferResponse:
    """Fill ``message`` (a new one by default, or e.g. a stream response's ``infer_response``) from ``response``;
    every output's data goes in ``raw_output_contents``, except for outputs written to shared memory."""
    if message is None:
        message = pb.ModelInferResponse()
    message.model_name = response.model_name
    message.model_version = response.model_version
    message.id = response.id
    if response.parameters:
        encode_parameters(message.parameters, response.parameters)
    # As Triton: one raw_output_contents entry per output, an empty one for an output written to shared memory
    # (Triton's C++ client indexes raw_output_contents by output position unchecked), and no parameters on it.
    outputs = message.outputs
    for output in response.outputs:
        tensor = outputs.add(name=output.name, datatype=output.datatype.wire_name, shape=output.shape)
        if output.parameters and output.shared_memory is None:
            encode_parameters(tensor.parameters, output.parameters)
    message.raw_output_contents.extend([b"" if output.shared_memory is not None
                                        else to_raw(output.data, output.datatype) for output in response.outputs])
    return message


# -- the client side ---------------------------------------------------------------------------------------------


def encode_request(model: str, inputs: Mapping[str, npt.NDArray[Any]], *, version: str = "",
                   datatypes: Mapping[str, DataType] | None = None, outputs: Sequence[str] = (),
                   parameters: Mapping[str, object] | None = None, request_id: str = "") -> pb.ModelInferRequest:
    """A ModelInferRequest carrying every input in ``raw_input_contents``."""
    message = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for name, array in inputs.items():
        datatype = (datatypes or {}).get(name) or DataType.from_numpy(array.dtype)
        message.inputs.add(name=name, datatype=datatype.wire_name, shape=array.shape)
        message.raw_input_contents.append(to_raw(array, datatype))
    for name in outputs:
        message.outputs.add(name=name)
    if parameters:
        encode_parameters(message.parameters, parameters)
    return message


def decode_response(message: pb.ModelInferResponse) -> InferResponse:
    """The protocol-free response; outputs in ``raw_output_contents`` become views over the message's bytes, those
    in typed ``contents`` arrays; outputs written to shared memory (an empty raw entry) come back with no data."""
    raw = message.raw_output_contents[:]
    outputs: list[OutputTensor] = []
    for index, tensor in enumerate(message.outputs[:]):
        datatype = DataType.from_wire(tensor.datatype)
        shape = tuple(tensor.shape[:])
        parameters = decode_parameters(tensor.parameters, f"output '{tensor.name}'") if tensor.parameters else {}
        if index < len(raw) and (raw[index] or element_count(shape) == 0):
            data = from_raw(datatype, shape, raw[index])
        elif index < len(raw):  # an empty entry: the output went to shared memory
            data = np.empty(0, datatype.numpy_dtype)
        else:
            field = _CONTENTS_FIELD.get(datatype)
            values = getattr(tensor.contents, field)[:] if field else []
            data = np.asarray(values, dtype=datatype.numpy_dtype if datatype is not DataType.BYTES else object)
            data = data.reshape(shape) if data.size else np.empty(0, datatype.numpy_dtype)
        outputs.append(OutputTensor(tensor.name, datatype, shape, data, parameters))
    return InferResponse(model_name=message.model_name, model_version=message.model_version, outputs=outputs,
                         id=message.id, parameters=decode_parameters(message.parameters, "response"))

