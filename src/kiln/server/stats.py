"""Per model-version inference statistics in Triton's shape, kept in monotonic nanoseconds.

Frontends render them (statistics extension); metrics read them. Updates happen from worker threads, so every
update and snapshot takes the lock.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.batching.model import ExecutionTimes


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += ns

    def add_many(self, count: int, total_ns: int) -> None:
        self.count += count
        self.ns += total_ns


@dataclass
class BatchStats:
    batch_size: int
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class ResponseStats:
    """Triton's statistics of the responses at one index of their requests' streams (decoupled models)."""

    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    empty_response: Duration = field(default_factory=Duration)
    cancel: Duration = field(default_factory=Duration)


@dataclass
class ModelStats:
    name: str
    version: str
    last_inference_ms: int = 0
    inference_count: int = 0
    execution_count: int = 0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    batch_stats: dict[int, BatchStats] = field(default_factory=dict)
    failures_by_reason: dict[str, int] = field(default_factory=dict)  # REJECTED, CANCELED, BACKEND, OTHER
    load_duration_s: float = 0.0
    response_stats: dict[str, ResponseStats] = field(default_factory=dict)  # by response index ("0", "1", ...)
    # Requests that frontend worker processes joined from several clients' requests (docs/serving.md), answered
    # successfully, and the clients' requests they carried (counted in ``success`` as well).
    joined_requests: int = 0
    joined_members: int = 0
    # Clients' requests a worker held back until an earlier call of theirs was answered, so they would leave
    # together (docs/serving.md, "Joined requests"; counted in ``success`` as well).
    held_members: int = 0


@dataclass(frozen=True)
class RequestTimes:
    """One successful request's durations in nanoseconds, for observers such as latency summaries."""

    model: str
    version: str
    request_ns: int
    queue_ns: int
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int


RequestObserver = Callable[[RequestTimes], None]


class StatsRecorder:
    def __init__(self, name: str, version: str, observers: list[RequestObserver] | None = None) -> None:
        self._lock = threading.Lock()
        self._stats = ModelStats(name=name, version=version)
        self.observers: list[RequestObserver] = observers if observers is not None else []

    def record_success(self, times: ExecutionTimes, enqueued_ns: list[int], end_ns: int,
                       joined: tuple[int, int, int] = (0, 0, 0)) -> None:
        """One execution that answered ``len(enqueued_ns)`` requests successfully; ``joined``: how many of its
        requests were joined from several clients' requests, how many clients' requests those carried, and how many
        clients' requests a worker held for an answer first."""
        requests = len(enqueued_ns)
        arrived_ns = sum(enqueued_ns)
        with self._lock:
            stats = self._stats
            stats.last_inference_ms = time.time_ns() // 1_000_000
            stats.inference_count += times.batch_size
            stats.execution_count += 1
            # Totals over the batch's requests at once: a joined request counts as each of its members, and a
            # per-request loop here would cost the event loop microseconds per member.
            stats.queue.add_many(requests, requests * times.start_ns - arrived_ns)
            stats.compute_input.add_many(requests, requests * times.compute_input_ns)
            stats.compute_infer.add_many(requests, requests * times.compute_infer_ns)
            stats.compute_output.add_many(requests, requests * times.compute_output_ns)
            stats.success.add_many(requests, requests * end_ns - arrived_ns)
            stats.joined_requests += joined[0]
            stats.joined_members += joined[1]
            stats.held_members += joined[2]
            batch = stats.batch_stats.setdefault(times.batch_size, BatchStats(times.batch_size))
            batch.compute_input.add(times.compute_input_ns)
            batch.compute_infer.add(times.compute_infer_ns)
            batch.compute_output.add(times.compute_output_ns)
        for observer in self.observers:
            for enqueued in enqueued_ns:
                observer(RequestTimes(stats.name, stats.version, end_ns - enqueued, times.start_ns - enqueued,
                                      times.compute_input_ns, times.compute_infer_ns, times.compute_output_ns))

    def record_failure(self, request_ns: int, reason: str = "BACKEND", requests: int = 1) -> None:
        """A failed request (``requests``: the clients' requests it stood for, InferRequest.members). ``reason``
        is Triton's failure label: REJECTED (queue full or timed out in the queue), CANCELED, BACKEND (the engine
        failed) or OTHER."""
        with self._lock:
            self._stats.fail.add_many(requests, requests * request_ns)
            self._stats.failures_by_reason[reason] = self._stats.failures_by_reason.get(reason, 0) + requests

    def record_response(self, index: int, outcome: str, infer_ns: int, output_ns: int) -> None:
        """One response of a decoupled model's request, the ``index``-th of its request: ``outcome`` is "success"
        or "fail" (outputs or an error: infer and output times, their sum), "empty" (the final flag alone: infer
        time) or "cancel" (the client left)."""
        with self._lock:
            entry = self._stats.response_stats.setdefault(str(index), ResponseStats())
            if outcome == "empty":
                entry.empty_response.add(infer_ns)
            elif outcome == "cancel":
                entry.cancel.add(infer_ns)
            else:
                entry.compute_infer.add(infer_ns)
                entry.compute_output.add(output_ns)
                (entry.success if outcome == "success" else entry.fail).add(infer_ns + output_ns)

    def set_load_duration(self, seconds: float) -> None:
        with self._lock:
            self._stats.load_duration_s = seconds

    def snapshot(self) -> ModelStats:
        with self._lock:
            return copy.deepcopy(self._stats)
