"""Several clients' requests as one: same-shaped batch requests stacked along the batch dimension, and their
answers split back.

A frontend worker that has several infer requests in hand at once (they reached it in the same event-loop turn)
hands those that could share a batch to the server process as one request (``InferRequest.members``), so the
server process does its per-request work once for all of them. Whether a joined request may run as it is is the
server's call (``Server.joined_rows``); otherwise it runs each member on its own, and every client gets the answer
or the error its own request would have got.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import orjson

from kiln.v2.types import InferRequest, InferResponse, InputTensor, OutputTensor

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
    dimension, the outputs asked for, how the answer is encoded), or None for a request that goes on its own: one
    with parameters the server reads (a priority, a timeout, a sequence, any a model may look at), a routing key,
    tensors in shared memory, or inputs that disagree on the batch dimension."""
    if routing_key is not None or not request.inputs or not _REQUEST_PARAMETERS.issuperset(request.parameters):
        return None
    rows = request.inputs[0].shape[0] if request.inputs[0].shape else 0
    if rows < 1:
        return None
    inputs = []
    for tensor in request.inputs:
        if tensor.shared_memory is not None or not tensor.shape or tensor.shape[0] != rows \
                or not _INPUT_PARAMETERS.issuperset(tensor.parameters):
            return None
        inputs.append((tensor.name, tensor.datatype, tensor.shape[1:]))
    outputs = []
    for output in request.outputs:
        if output.shared_memory is not None:
            return None
        outputs.append((output.name, output.classification,
                        orjson.dumps(output.parameters, option=orjson.OPT_SORT_KEYS) if output.parameters else b""))
    encoding = tuple(sorted(request.parameters.items()))
    return request.model_name, request.model_version, tuple(inputs), tuple(outputs), encoding


def rows_of(request: InferRequest) -> int:
    """The batch dimension of a joinable request (``join_key`` checked that every input agrees)."""
    return request.inputs[0].shape[0]


def slice_request(request: InferRequest, start: int, stop: int, members: int, request_id: str = "") -> InferRequest:
    """Rows ``start:stop`` of a joined request (views, no copy), standing for ``members`` clients' requests."""
    inputs = [InputTensor(t.name, t.datatype, (stop - start, *t.shape[1:]), t.data[start:stop], t.parameters)
              for t in request.inputs]
    return InferRequest(request.model_name, inputs, request.model_version, request_id, request.outputs,
                        request.parameters, members)


def split_response(response: InferResponse, rows: Sequence[int], ids: Sequence[str]) -> list[InferResponse]:
    """A joined request's answer as its members' answers, in order (views, no copy): member i gets the next
    ``rows[i]`` rows of every output and its own request id."""
    answers = []
    start = 0
    for count, request_id in zip(rows, ids, strict=True):
        stop = start + count
        outputs = [OutputTensor(o.name, o.datatype, (count, *o.shape[1:]), o.data[start:stop], dict(o.parameters))
                   for o in response.outputs]
        answers.append(InferResponse(response.model_name, response.model_version, outputs, request_id,
                                     dict(response.parameters)))
        start = stop
    return answers
