"""Shadow traffic: mirror a fraction of a model's requests to a candidate version and compare its answers.

The mirror starts after the primary answer is ready and never changes or delays it: on the event loop it is a task,
for blocking callers a job on a small thread pool. At most ``MAX_INFLIGHT`` mirrors run per model; past that a
request is not mirrored and counts as skipped. Each mirrored answer is compared output by output with the primary's:
floating-point outputs with ``numpy.allclose(atol, rtol)``, others exactly; outputs shaped like class scores
(2-D, more than one column) are also compared on their top-1 class per row.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.errors import KilnError
from kiln.tensor import DataType
from kiln.v2.types import InferRequest, InferResponse, InputTensor, OutputTensor, RequestedOutput

log = logging.getLogger("kiln.server")

DEFAULT_ATOL = 1e-3
DEFAULT_RTOL = 1e-3
MAX_INFLIGHT = 64
_FLOATS = (DataType.FP16, DataType.FP32, DataType.FP64, DataType.BF16)


@dataclass(frozen=True)
class ShadowStats:
    """What shadowing one model to ``version`` found so far. ``max_abs_diff`` is over floating-point outputs."""

    version: str
    fraction: float
    atol: float
    rtol: float
    inflight: int
    mirrored: int  # mirrors that finished (agreed + disagreed + errors)
    agreed: int
    disagreed: int
    errors: int
    skipped: int  # sampled but not sent: too many mirrors in flight, or the version was not ready
    max_abs_diff: float
    top1_rows: int
    top1_agreed: int


@dataclass(frozen=True)
class Comparison:
    agreed: bool
    max_abs_diff: float = 0.0
    top1_rows: int = 0
    top1_agreed: int = 0


def compare_outputs(primary: Sequence[OutputTensor], shadow: Sequence[OutputTensor], atol: float,
                    rtol: float) -> Comparison:
    """Whether the shadow's outputs agree with the primary's, name by name."""
    return compare_arrays({o.name: o.data for o in primary}, {o.name: o.data for o in shadow}, atol, rtol)


def compare_arrays(reference: Mapping[str, npt.NDArray[Any]], other: Mapping[str, npt.NDArray[Any]], atol: float,
                   rtol: float) -> Comparison:
    """Compare every array of ``reference`` with the same-named one of ``other`` (a missing one disagrees)."""
    agreed, max_diff, rows, top1 = True, 0.0, 0, 0
    for name, mine in reference.items():
        theirs = other.get(name)
        if theirs is None or theirs.shape != mine.shape:
            agreed = False
            continue
        if _is_float(mine.dtype) and _is_float(theirs.dtype):
            a, b = mine.astype(np.float64), theirs.astype(np.float64)
            if a.size:
                max_diff = max(max_diff, float(np.max(np.abs(a - b))))
            agreed = agreed and bool(np.allclose(a, b, atol=atol, rtol=rtol))
            if a.ndim == 2 and a.shape[1] > 1:
                rows += a.shape[0]
                top1 += int(np.count_nonzero(np.argmax(a, axis=1) == np.argmax(b, axis=1)))
        else:
            agreed = agreed and bool(np.array_equal(mine, theirs))
    return Comparison(agreed, max_diff, rows, top1)


def _is_float(dtype: np.dtype[Any]) -> bool:
    try:
        return DataType.from_numpy(dtype) in _FLOATS  # also bfloat16, which numpy does not call floating
    except KilnError:
        return False


def mirror_request(request: InferRequest, version: int) -> InferRequest:
    """The copy of ``request`` sent to the shadow version (same inputs and requested outputs)."""
    outputs = [RequestedOutput(o.name, o.classification, o.parameters) for o in request.outputs]
    inputs = [InputTensor(t.name, t.datatype, t.shape, t.data, t.parameters) for t in request.inputs]
    return InferRequest(request.model_name, inputs, str(version), request.id, outputs, dict(request.parameters))


def uses_shared_memory(request: InferRequest) -> bool:
    """Such a request is not mirrored: its regions are released as soon as the primary answer is sent."""
    return bool(request.member_rows) or any(t.shared_memory for t in request.inputs) \
        or any(o.shared_memory for o in request.outputs)


class Shadow:
    """Mirrors one model's requests to ``version``; counts and compares under a lock (mirrors end on any thread)."""

    def __init__(self, model: str, version: int, fraction: float, atol: float, rtol: float,
                 pool: Callable[[], ThreadPoolExecutor], max_inflight: int = MAX_INFLIGHT) -> None:
        self.model = model
        self.version = version
        self.fraction = fraction
        self.atol = atol
        self.rtol = rtol
        self._pool = pool
        self._max_inflight = max_inflight
        self._lock = threading.Lock()
        self._random = random.Random()
        self._tasks: set[asyncio.Task[None]] = set()  # kept referenced until done
        self._inflight = 0
        self._agreed = self._disagreed = self._errors = self._skipped = 0
        self._max_diff = 0.0
        self._top1_rows = self._top1_agreed = 0

    def sample(self) -> bool:
        """Decide whether to mirror one request; True reserves an in-flight slot that a run must release."""
        if self._random.random() >= self.fraction:
            return False
        with self._lock:
            if self._inflight >= self._max_inflight:
                self._skipped += 1
                return False
            self._inflight += 1
            return True

    def skip(self) -> None:
        """Release a reserved slot without mirroring (the shadow version cannot take the request)."""
        with self._lock:
            self._inflight -= 1
            self._skipped += 1

    def start(self, submit: Callable[[], Awaitable[InferResponse]], primary: list[OutputTensor]) -> None:
        """Run a mirror as a task on the running event loop."""
        task = asyncio.get_running_loop().create_task(self._run(submit, primary))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def start_sync(self, submit: Callable[[], InferResponse], primary: list[OutputTensor]) -> None:
        """Run a mirror on the shadow thread pool."""
        try:
            self._pool().submit(self._run_sync, submit, primary)
        except RuntimeError:  # the pool is shut down: the interpreter is exiting
            self.skip()

    async def _run(self, submit: Callable[[], Awaitable[InferResponse]], primary: list[OutputTensor]) -> None:
        try:
            response = await submit()
        except Exception as exc:
            self._error(exc)
        else:
            self._record(compare_outputs(primary, response.outputs, self.atol, self.rtol))

    def _run_sync(self, submit: Callable[[], InferResponse], primary: list[OutputTensor]) -> None:
        try:
            response = submit()
        except Exception as exc:
            self._error(exc)
        else:
            self._record(compare_outputs(primary, response.outputs, self.atol, self.rtol))

    def _error(self, exc: Exception) -> None:
        log.debug("model '%s': shadow request to version %d failed: %s", self.model, self.version, exc)
        with self._lock:
            self._inflight -= 1
            self._errors += 1

    def _record(self, result: Comparison) -> None:
        with self._lock:
            self._inflight -= 1
            if result.agreed:
                self._agreed += 1
            else:
                self._disagreed += 1
            self._max_diff = max(self._max_diff, result.max_abs_diff)
            self._top1_rows += result.top1_rows
            self._top1_agreed += result.top1_agreed

    def stats(self) -> ShadowStats:
        with self._lock:
            return ShadowStats(str(self.version), self.fraction, self.atol, self.rtol, self._inflight,
                               self._agreed + self._disagreed + self._errors, self._agreed, self._disagreed,
                               self._errors, self._skipped, self._max_diff, self._top1_rows, self._top1_agreed)
