"""Stage probes for served_stages.py: wrappers around the functions one inference request passes through, in the HTTP
frontend (its worker processes or the server process), the link between them, the batcher and a CUDA-graph engine,
each appending (CLOCK_MONOTONIC nanoseconds, stage) to a list that goes to ``<directory>/<pid>.txt``.

A process loads them through the ``sitecustomize`` module served_stages.py writes (``install``). Every probe names
a function that must exist: one renamed raises here, and the process then runs without probes (Python reports the
error at start-up), so served_stages.py finds no requests and fails rather than leave a stage out of the report.
Each probe costs about a microsecond, and a request passes some thirty.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import os
import time
from collections.abc import Callable
from typing import Any

FLUSH_EVERY = 4096

# (module, class, method, how): "at" records the call; "span" records its start and its end (".end");
# "async" is a span around a coroutine.
PROBES: tuple[tuple[str, str, str, str], ...] = (
    ("kiln.frontends.http.limits", "LimitedHttpToolsProtocol", "on_message_begin", "at"),
    ("kiln.frontends.http.limits", "LimitedHttpToolsProtocol", "on_headers_complete", "at"),
    ("kiln.frontends.http.limits", "LimitedHttpToolsProtocol", "on_message_complete", "at"),
    ("kiln.frontends.http.limits", "HeadWithBody", "write", "at"),
    ("kiln.frontends.http.endpoints", "Endpoints", "infer", "async"),
    ("kiln.frontends.http.worker_app", "CoreClient", "infer", "async"),
    ("kiln.frontends.http.infer_lane", "InferLane", "take", "span"),
    ("kiln.frontends.http.infer_lane", "InferLane", "_answered", "at"),
    ("kiln.frontends.http.infer_lane", "LaneProtocol", "_respond", "at"),
    ("kiln.frontends.handoff.frames", "FrameProtocol", "data_received", "at"),
    ("kiln.frontends.handoff.frames", "FrameProtocol", "_write", "at"),
    ("kiln.frontends.handoff.infer", "InferHandoff", "answer", "async"),
    ("kiln.server.server", "Server", "infer", "async"),
    ("kiln.server.infer", "InferPath", "admit", "span"),
    ("kiln.batching.launched", "LaunchRunner", "submit", "at"),
    ("kiln.batching.launched", "LaunchRunner", "_launch", "span"),
    ("kiln.batching.launched", "LaunchRunner", "_finish", "span"),
    ("kiln.batching.model", "BatchModel", "responses", "span"),
)
# Loaded with the first batcher (only the server process, or a direct engine's, imports torch).
TORCH_PROBES: tuple[tuple[str, str, str, str], ...] = (
    ("kiln.engines.torch.engine", "TorchEngine", "_source", "span"),
    ("kiln.engines.torch.cuda_graphs", "CudaGraphs", "replay", "span"),
    ("kiln.engines.torch.engine", "TorchEngine", "_host_output", "span"),
    ("kiln.engines.torch.engine", "_LaunchedGraph", "collect", "span"),
)
DEVICE_DONE = "LaunchRunner.device_done"  # the waiter thread saw the batch's device work finish

_events: list[tuple[int, str]] = []
_path = ""


def install(directory: str) -> None:
    """Wrap every probe's function in this process; the events go to ``directory`` when the process exits (and
    every ``FLUSH_EVERY`` events, so a process that is killed loses few)."""
    global _path
    _path = os.path.join(directory, f"{os.getpid()}.txt")
    atexit.register(flush)
    _wrap_all(PROBES)
    _watch_launches()


def flush() -> None:
    global _events
    if _events:
        events, _events = _events, []
        with open(_path, "a") as out:
            out.write("".join(f"{ns} {stage}\n" for ns, stage in events))


def record(stage: str) -> None:
    _events.append((time.monotonic_ns(), stage))
    if len(_events) >= FLUSH_EVERY:
        flush()


def _wrap_all(probes: tuple[tuple[str, str, str, str], ...]) -> None:
    """Every probe or none: each target is looked up before the first is wrapped."""
    targets = [(getattr(importlib.import_module(module), cls), cls, method, how)
               for module, cls, method, how in probes]
    for owner, _, method, _ in targets:
        getattr(owner, method)  # raises for a method that is gone
    for target in targets:
        _wrap(*target)


def _wrap(owner: Any, cls: str, method: str, how: str) -> None:
    original: Callable[..., Any] = getattr(owner, method)
    stage = f"{cls}.{method}"
    if how == "at":
        def probe(*args: Any, **kwargs: Any) -> Any:
            record(stage)
            return original(*args, **kwargs)
    elif how == "span":
        def probe(*args: Any, **kwargs: Any) -> Any:
            record(stage)
            try:
                return original(*args, **kwargs)
            finally:
                record(stage + ".end")
    else:
        async def probe(*args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
            record(stage)
            try:
                return await original(*args, **kwargs)
            finally:
                record(stage + ".end")
    setattr(owner, method, functools.wraps(original)(probe))


class _DeviceWait:
    """A launched batch whose ``wait`` (on the waiter thread) records when the device finished it."""

    def __init__(self, launched: Any) -> None:
        self._launched = launched

    def wait(self) -> None:
        self._launched.wait()
        record(DEVICE_DONE)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._launched, name)


def _watch_launches() -> None:
    from kiln.batching import launched

    runner = launched.LaunchRunner
    post, init = runner._post_when_done, runner.__init__
    torch_probes: list[bool] = []

    def post_when_done(self: Any, flight: Any) -> None:
        flight.launched = _DeviceWait(flight.launched)
        post(self, flight)

    def first_init(self: Any, *args: Any, **kwargs: Any) -> None:
        if not torch_probes:
            torch_probes.append(True)
            try:
                importlib.import_module("torch")
            except ImportError:
                pass
            else:
                _wrap_all(TORCH_PROBES)
        init(self, *args, **kwargs)

    runner._post_when_done = post_when_done  # type: ignore[method-assign]
    runner.__init__ = first_init  # type: ignore[method-assign]
