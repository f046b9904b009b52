"""Decoupled Python models (``model_transaction_policy { decoupled: true }``): zero to many responses per request.

Each request handed to ``execute`` carries a :class:`ResponseSender` (``request.get_response_sender()``). The model
sends responses through it from any thread, during ``execute`` or after it returned, and ends the request with the
final flag (``send(flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL)``, with or without a last response). ``execute``
returns None. Responses go to a :class:`ResponseSink` the server supplies, one per request.

kiln ends a request whose sender was dropped without the final flag (the model kept neither the request nor its
sender): the client's stream would otherwise stay open for ever. A warning names the model.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy.typing as npt

from kiln.config.spec import ModelSpec
from kiln.engines.python import compat
from kiln.engines.python.api import triton_error
from kiln.engines.python.tensors import batch_size, collect_outputs
from kiln.errors import InternalError, KilnError

Array = npt.NDArray[Any]
log = logging.getLogger("kiln.engines.python")


class ResponseSink(Protocol):
    """Where one request's responses go (the server's stream of that request). Called from any thread."""

    def put(self, outputs: Mapping[str, Array] | None, error: KilnError | None, final: bool) -> None:
        """One response: outputs, or an error, or neither (a final flag alone)."""

    @property
    def cancelled(self) -> bool:
        """True once the client went away; later responses are dropped."""


@dataclass(frozen=True)
class DecoupledCall:
    """One request of a decoupled execute: its validated inputs, the outputs it wants, where its responses go."""

    inputs: Mapping[str, Array]
    outputs: Sequence[str]
    sink: ResponseSink


class _SenderState:
    """What the sender and its drop handler share (the handler must not hold the sender itself)."""

    def __init__(self, model: str, sink: ResponseSink) -> None:
        self.model = model
        self.sink = sink
        self.closed = False
        self.lock = threading.Lock()

    def close_once(self) -> bool:
        """Mark the request finished; False if it already was."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            return True


def _end_dropped(state: _SenderState) -> None:
    if state.close_once():
        log.warning("model '%s': a response sender was dropped without the final flag; kiln ended the request "
                    "(send flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL when a request is done)", state.model)
        state.sink.put(None, None, True)


class ResponseSender:
    """Triton's ``InferenceResponseSender``: ``send(response=None, flags=0)``, ``is_cancelled()``."""

    def __init__(self, spec: ModelSpec, call: DecoupledCall) -> None:
        self._spec = spec
        self._outputs = list(call.outputs)
        self._rows = batch_size(spec, call.inputs)
        self._state = _SenderState(spec.name, call.sink)
        weakref.finalize(self, _end_dropped, self._state)

    @property
    def closed(self) -> bool:
        return self._state.closed

    def is_cancelled(self) -> bool:
        return self._state.sink.cancelled

    def send(self, response: compat.InferenceResponse | None = None, flags: int = 0) -> None:
        final = bool(flags & compat.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is None and not final:
            raise compat.TritonModelException("send() needs an InferenceResponse, or flags="
                                              "TRITONSERVER_RESPONSE_COMPLETE_FINAL to end the request")
        if response is not None and not isinstance(response, compat.InferenceResponse):
            raise compat.TritonModelException(f"send() takes a pb_utils.InferenceResponse; got "
                                              f"{type(response).__name__}")
        with self._state.lock:
            if self._state.closed:
                raise compat.TritonModelException("Unable to send response. Response sender has been closed.")
            self._state.closed = final
        outputs, error = self._convert(response)
        self._state.sink.put(outputs, error, final)
        if error is not None and response is not None and not response.has_error():
            raise compat.TritonModelException(error.message)  # a malformed response is the model's bug: say so

    def fail(self, error: KilnError) -> None:
        """End the request with ``error`` unless it has ended already (``execute`` raised)."""
        if self._state.close_once():
            self._state.sink.put(None, error, True)

    def _convert(self, response: compat.InferenceResponse | None) -> tuple[dict[str, Array] | None,
                                                                            KilnError | None]:
        if response is None:
            return None, None
        error = response.error()
        if error is not None:
            return None, triton_error(self._spec.name, error)
        produced: dict[str, Any] = {}
        for tensor in response.output_tensors():
            if not isinstance(tensor, compat.Tensor):
                return None, InternalError(f"model '{self._spec.name}': InferenceResponse output_tensors must be "
                                           f"pb_utils.Tensor objects; found {type(tensor).__name__}")
            produced[tensor.name()] = tensor.as_numpy()
        try:
            return collect_outputs(self._spec, produced, self._outputs, self._rows), None
        except KilnError as exc:
            return None, exc


def decoupled_requests(spec: ModelSpec, calls: Sequence[DecoupledCall],
                       prepare: Any) -> tuple[list[compat.InferenceRequest], list[ResponseSender]]:
    """The ``pb_utils.InferenceRequest`` objects ``execute`` gets, each with its sender. ``prepare`` turns
    validated inputs into what the model sees (BYTES as bytes objects, reshapes)."""
    requests, senders = [], []
    for call in calls:
        sender = ResponseSender(spec, call)
        tensors = [compat.Tensor(name, array) for name, array in prepare(spec, call.inputs).items()]
        request = compat.InferenceRequest(model_name=spec.name, requested_output_names=list(call.outputs),
                                          inputs=tensors)
        request.attach_sender(sender)
        requests.append(request)
        senders.append(sender)
    return requests, senders
