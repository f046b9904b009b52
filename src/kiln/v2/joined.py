"""Several clients' requests as one: same-shaped batch requests stacked along the batch dimension, and their
answers split back.

A frontend worker that has several infer requests in hand at once (they reached it in the same event-loop turn)
hands those that could share a batch to the server process as one request (``InferRequest.members``), so the
server process does its per-request work once for all of them. Whether a joined request may run as it is is the
server's call (``Server.joined_rows``); otherwise it runs each member on its own, and every client gets the answer
or the error its own request would have got. Requests whose tensors lie in system shared memory join too: the
joined request names each member's region (``member_regions``, ``member_rows``), the server reads each member's
rows where they lie and writes each member's outputs into its own region, so no bytes are copied to join them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from kiln.v2.types import (
    SHM_BYTE_SIZE,
    SHM_OFFSET,
    SHM_PARAMETERS,
    SHM_REGION,
    InferRequest,
    InferResponse,
    InputTensor,
    OutputTensor,
    RequestedOutput,
    SharedMemoryRef,
)

# Parameters that only say how the HTTP body carries tensors, which the worker reads and writes itself: requests
# may differ in them and still share a batch.
_INPUT_PARAMETERS = frozenset({"binary_data_size"})
# Request parameters the server process never reads for a single-response infer: how the worker encodes the answer
# (binary_data_output), and what a gRPC stream of a decoupled model sends last (triton_enable_empty_final_response,
# which perf_analyzer sets on every gRPC request). Joined requests must still agree on them.
_REQUEST_PARAMETERS = frozenset({"binary_data_output", "triton_enable_empty_final_response"})
MAX_MEMBERS = 64
"""The most requests a worker joins into one (a batch rarely needs more; the server process splits what exceeds
a model's max_batch_size)."""


def join_key(request: InferRequest, routing_key: str | None) -> Hashable | None:
    """What requests must share to be joined (model, version, inputs' names, types and shapes past the batch
    dimension, whether they lie in shared memory, the outputs asked for and whether each goes to shared memory, how
    the answer is encoded), or None for a request that goes on its own: one with parameters the server reads (a
    priority, a timeout, a sequence, any a model may look at), a routing key, some inputs in shared memory and
    others not, an output in shared memory for inputs in the request, or inputs that disagree on the batch
    dimension. Members may name different regions: each keeps its own (``member_regions``)."""
    if routing_key is not None or not request.inputs or not _REQUEST_PARAMETERS.issuperset(request.parameters):
        return None
    rows = request.inputs[0].shape[0] if request.inputs[0].shape else 0
    if rows < 1:
        return None
    in_regions = request.inputs[0].shared_memory is not None
    allowed = SHM_PARAMETERS if in_regions else _INPUT_PARAMETERS  # where in shared memory: each member its own
    inputs = []
    for tensor in request.inputs:
        if (tensor.shared_memory is not None) != in_regions or not tensor.shape or tensor.shape[0] != rows \
                or not allowed.issuperset(tensor.parameters):
            return None
        inputs.append((tensor.name, tensor.datatype, tensor.shape[1:]))
    outputs = []
    for output in request.outputs:
        parameters = output.parameters
        if output.shared_memory is not None:
            if not in_regions:  # members' regions travel with inputs in regions only (member_rows)
                return None
            parameters = {k: v for k, v in parameters.items() if k not in SHM_PARAMETERS}
        outputs.append((output.name, output.classification, output.shared_memory is not None,
                        orjson.dumps(parameters, option=orjson.OPT_SORT_KEYS) if parameters else b""))
    encoding = tuple(sorted(request.parameters.items()))
    return request.model_name, request.model_version, in_regions, tuple(inputs), tuple(outputs), encoding


def rows_of(request: InferRequest) -> int:
    """The batch dimension of a joinable request (``join_key`` checked that every input agrees)."""
    return request.inputs[0].shape[0]


def slice_request(request: InferRequest, start: int, stop: int, members: int, request_id: str = "",
                  first: int = 0, held: int = 0) -> InferRequest:
    """Rows ``start:stop`` of a joined request (views, no copy), standing for ``members`` clients' requests from
    member ``first`` on, ``held`` of which a worker held for an answer. Where the tensors lie in the members'
    regions (``member_rows``), the slice names those members' regions: a single member's slice is the request its
    client sent."""
    if request.member_rows:
        sliced = _members_of(request, first, first + members, request_id)
    else:
        inputs = [InputTensor(t.name, t.datatype, (stop - start, *t.shape[1:]), t.data[start:stop], t.parameters)
                  for t in request.inputs]
        sliced = InferRequest(request.model_name, inputs, request.model_version, request_id, request.outputs,
                              request.parameters, members)
    sliced.held = held
    return sliced


def _members_of(request: InferRequest, first: int, stop: int, request_id: str) -> InferRequest:
    rows = request.member_rows[first:stop]
    total = sum(rows)
    if len(rows) == 1:
        inputs = [_member_input(t, total, t.member_regions[first]) for t in request.inputs]
        outputs = [o if not o.member_regions else _member_output(o, o.member_regions[first])
                   for o in request.outputs]
        return InferRequest(request.model_name, inputs, request.model_version, request_id, outputs,
                            request.parameters)
    inputs = [InputTensor(t.name, t.datatype, (total, *t.shape[1:]), _no_data(t), {},
                          member_regions=t.member_regions[first:stop]) for t in request.inputs]
    outputs = [o if not o.member_regions else
               RequestedOutput(o.name, o.classification, o.parameters, member_regions=o.member_regions[first:stop])
               for o in request.outputs]
    return InferRequest(request.model_name, inputs, request.model_version, request_id, outputs,
                        request.parameters, len(rows), rows)


def _member_input(tensor: InputTensor, rows: int, ref: SharedMemoryRef) -> InputTensor:
    return InputTensor(tensor.name, tensor.datatype, (rows, *tensor.shape[1:]), _no_data(tensor),
                       region_parameters(ref), ref)


def _member_output(output: RequestedOutput, ref: SharedMemoryRef) -> RequestedOutput:
    return RequestedOutput(output.name, output.classification, {**output.parameters, **region_parameters(ref)}, ref)


def _no_data(tensor: InputTensor) -> npt.NDArray[Any]:
    """What a tensor in shared memory carries until the server reads its region (as the codecs leave it)."""
    return np.empty(0, tensor.datatype.numpy_dtype)


def region_parameters(ref: SharedMemoryRef) -> dict[str, int | str]:
    """The tensor parameters that name ``ref`` (the shared-memory extension's)."""
    parameters: dict[str, int | str] = {SHM_REGION: ref.region, SHM_BYTE_SIZE: ref.byte_size}
    if ref.offset:
        parameters[SHM_OFFSET] = ref.offset
    return parameters


def split_response(response: InferResponse, rows: Sequence[int], ids: Sequence[str]) -> list[InferResponse]:
    """A joined request's answer as its members' answers, in order (views, no copy): member i gets the next
    ``rows[i]`` rows of every output and its own request id. An output the server wrote into the members' regions
    has no data here; each member's answer says only that its own is in shared memory, as the codecs need."""
    answers = []
    start = 0
    for count, request_id in zip(rows, ids, strict=True):
        stop = start + count
        outputs = [OutputTensor(o.name, o.datatype, (count, *o.shape[1:]), o.data[start:stop], dict(o.parameters))
                   if o.shared_memory is None else
                   OutputTensor(o.name, o.datatype, (count, *o.shape[1:]), o.data, {}, o.shared_memory)
                   for o in response.outputs]
        answers.append(InferResponse(response.model_name, response.model_version, outputs, request_id,
                                     dict(response.parameters)))
        start = stop
    return answers
