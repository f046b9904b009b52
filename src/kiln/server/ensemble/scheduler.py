"""Run an ensemble request: each step goes through its own model's scheduler (so dynamic batching still applies)
as soon as its inputs exist, independent steps concurrently. Tensors pass between steps as the same numpy arrays,
never copied."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kiln.batching.model import ExecutionTimes
from kiln.errors import InternalError, KilnError, VersionUnloadingError
from kiln.server.classification import classify
from kiln.server.ensemble.plan import EnsemblePlan, Step
from kiln.server.model import LoadedModel
from kiln.server.stats import Duration
from kiln.tensor import DataType
from kiln.v2.types import InferRequest, InferResponse, InputTensor, OutputTensor, RequestedOutput

# Sends one step's request to its model (resolve, validate, that model's scheduler); raises KilnError.
StepDispatch = Callable[[InferRequest], Awaitable[InferResponse]]


@dataclass
class StepStats:
    """One step's record inside this ensemble (the step's model keeps its own statistics as well)."""

    index: int
    model_name: str
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)


class EnsembleScheduler:
    def __init__(self, model: LoadedModel, plan: EnsemblePlan, dispatch: StepDispatch) -> None:
        self.model = model
        self.plan = plan
        self._dispatch = dispatch
        self._lock = threading.Lock()
        self._steps = [StepStats(s.index, s.model_name) for s in plan.steps]
        self._inflight = 0
        self._closed = False
        self._idle = threading.Condition(self._lock)

    @property
    def inflight(self) -> int:
        return self._inflight

    def step_statistics(self) -> list[StepStats]:
        with self._lock:
            return [StepStats(s.index, s.model_name, Duration(s.success.count, s.success.ns),
                              Duration(s.fail.count, s.fail.ns)) for s in self._steps]

    async def submit(self, request: InferRequest, batch_size: int) -> InferResponse:
        with self._lock:
            if self._closed:
                raise VersionUnloadingError(f"ensemble '{self.model.name}' version {self.model.version} is "
                                            f"unloading")
            self._inflight += 1
        start = time.monotonic_ns()
        try:
            tensors = await self._run_steps(request)
        except BaseException as exc:
            self.model.stats.record_failure(time.monotonic_ns() - start)
            if isinstance(exc, (KilnError, asyncio.CancelledError)):
                raise
            raise InternalError(f"ensemble '{self.model.name}': {type(exc).__name__}: {exc}") from exc
        finally:
            with self._lock:
                self._inflight -= 1
                self._idle.notify_all()
        response = self._response(request, tensors)
        end = time.monotonic_ns()
        self.model.stats.record_success(ExecutionTimes(batch_size, start, 0, end - start, 0), [start], end)
        return response

    def submit_sync(self, request: InferRequest, batch_size: int) -> InferResponse:
        return asyncio.run(self.submit(request, batch_size))

    def close(self) -> None:
        """Refuse new requests and wait for the running ones; the step models are released on their own."""
        with self._lock:
            self._closed = True
            while self._inflight:
                self._idle.wait()

    async def _run_steps(self, request: InferRequest) -> dict[str, OutputTensor | InputTensor]:
        tensors: dict[str, OutputTensor | InputTensor] = {t.name: t for t in request.inputs}
        started: set[int] = set()
        running: dict[asyncio.Task[InferResponse], Step] = {}
        try:
            while len(started) < len(self.plan.steps) or running:
                for step in self.plan.ready_steps(set(tensors), started):
                    started.add(step.index)
                    running[asyncio.ensure_future(self._run_step(step, request, tensors))] = step
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    step = running.pop(task)
                    produced = {o.name: o for o in task.result().outputs}
                    for model_output, tensor in step.outputs:
                        tensors[tensor] = produced[model_output]
        finally:
            for task in running:
                task.cancel()
        return tensors

    async def _run_step(self, step: Step, request: InferRequest,
                        tensors: dict[str, OutputTensor | InputTensor]) -> InferResponse:
        inputs = [InputTensor(name, tensors[tensor].datatype, tensors[tensor].shape, tensors[tensor].data)
                  for name, tensor in step.inputs]
        step_request = InferRequest(model_name=step.model_name, model_version=step.version_text, inputs=inputs,
                                    id=request.id, outputs=[RequestedOutput(name) for name, _ in step.outputs],
                                    parameters=request.parameters)
        start = time.monotonic_ns()
        stats = self._steps[step.index]
        try:
            response = await self._dispatch(step_request)
        except KilnError as exc:
            with self._lock:
                stats.fail.add(time.monotonic_ns() - start)
            raise type(exc)(f"ensemble '{self.model.name}' {step.label}: {exc}") from exc
        with self._lock:
            stats.success.add(time.monotonic_ns() - start)
        return response

    def _response(self, request: InferRequest, tensors: dict[str, OutputTensor | InputTensor]) -> InferResponse:
        wanted = [(o.name, o.classification) for o in request.outputs] or \
            [(t.name, 0) for t in self.model.spec.outputs]
        outputs = [self._output(name, tensors[name], classification) for name, classification in wanted]
        return InferResponse(model_name=self.model.name, model_version=str(self.model.version), outputs=outputs,
                             id=request.id)

    def _output(self, name: str, tensor: OutputTensor | InputTensor, classification: int) -> OutputTensor:
        if classification > 0:
            classes = classify(self.model.name, name, tensor.data, classification, self.model.spec.batching,
                               self.model.labels.get(name, []))
            return OutputTensor(name, DataType.BYTES, classes.shape, classes)
        return OutputTensor(name, tensor.datatype, tensor.shape, tensor.data)
