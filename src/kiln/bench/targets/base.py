"""The interface every bench target offers, whatever carries its requests.

A target opens (loads the model, connects, or starts a server), tells what inputs the model takes, checks one
request, then generates load levels on demand: ``start(level, recorder)`` keeps requests going in the background
and records each one; ``stop()`` ends the level and waits for the requests in flight. Two bases implement the
load loops: :class:`~kiln.bench.targets.threaded.ThreadedTarget` (a thread per request slot, for blocking calls
such as ``engine.infer``) and :class:`~kiln.bench.targets.aio.AsyncTarget` (one event loop, a task per slot).
"""

from __future__ import annotations

import abc
from types import TracebackType

from kiln.bench.data import ModelInputs, Request
from kiln.bench.records import Level, Recorder
from kiln.bench.schedule import SendCounts
from kiln.bench.server_stats import ServerCounters
from kiln.errors import UnavailableError

REQUEST_TIMEOUT_S = 60.0
"""A request that takes longer fails (and counts as an error), so stopping a level never hangs on a stuck call."""
STOP_TIMEOUT_S = REQUEST_TIMEOUT_S + 10.0


class RequestFailedError(UnavailableError):
    """The target could not answer the check request sent before measuring."""


class Target(abc.ABC):
    """One way of reaching the model; see the module docstring."""

    kind: str = ""
    url: str | None = None
    in_process: bool = False
    """True when the model runs in this process (direct, inprocess): memory is this process's."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.requests: list[Request] = []

    @abc.abstractmethod
    def open(self) -> ModelInputs:
        """Load or connect; return the model's inputs."""

    def prepare(self, requests: list[Request]) -> None:
        """Keep the request data and send one request, raising RequestFailedError with the cause if it fails."""
        if not requests:
            raise ValueError("a target needs at least one request to send")
        self.requests = requests
        try:
            self.check()
        except Exception as exc:
            raise RequestFailedError(f"target '{self.kind}': the check request to model '{self.model}' failed, so "
                                     f"nothing was measured: {type(exc).__name__}: {exc}") from exc

    @abc.abstractmethod
    def check(self) -> None:
        """Send one request and raise if it fails."""

    @abc.abstractmethod
    def start(self, level: Level, recorder: Recorder) -> None: ...

    @abc.abstractmethod
    def stop(self) -> SendCounts | None:
        """End the level; the send counts of request-rate mode (None in concurrency mode)."""

    def server_stats(self) -> ServerCounters | None:
        """The model's cumulative server statistics, or None where there is no server."""
        return None

    def process_id(self) -> int | None:
        """The process whose memory is measured, or None when unknown."""
        return None

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Target:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
