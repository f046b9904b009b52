"""A Python model instance in its own process, so that a model that dies (``os._exit``, a signal, a segfault in
native code) fails only the batch it was running, not the server.

Opt in per model with ``parameters { key: "KILN_EXECUTION_ISOLATION" value { string_value: "process" } }``. The
instance runs in ``python -m kiln.engines.python.child`` (see that module); each batch's tensors go over a socket
as pickles (numpy arrays pickle as one buffer each), which costs a copy each way per batch: the price of the
isolation. When the child dies, the batch inside it fails with UNAVAILABLE naming the model and how the child
ended, the death is logged and reported to ``on_fault`` (the server shows it as the version's reason), and the
next batch starts a new child after a backoff. After ``KILN_MAX_RESTARTS`` deaths in a row (default 5; a batch
that succeeds resets the count) no child is started again: every request is answered UNAVAILABLE with the reason
and ``on_fault`` is told the instance is lost.

Decoupled models are refused (their responses would have to stream back over the socket), and BLS calls from an
isolated model fail with UNSUPPORTED (the child has no server to call into).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kiln.config.spec import ModelSpec
from kiln.engines.base import Array, Engine, EngineOptions
from kiln.errors import ConfigError, ErrorCode, InternalError, KilnError, UnavailableError, error_for_code

log = logging.getLogger("kiln.engines.python")

ISOLATION = "KILN_EXECUTION_ISOLATION"
MAX_RESTARTS = "KILN_MAX_RESTARTS"
DEFAULT_MAX_RESTARTS = 5
_MODES = ("none", "process")
_BACKOFF_FIRST_S = 0.25
_BACKOFF_MAX_S = 5.0
_FINALIZE_TIMEOUT_S = 30.0
_EXIT_WAIT_S = 5.0

FaultListener = Callable[[str, bool], None]
"""Told ``(reason, lost)`` when a child dies; ``lost`` is True once no new child will be started."""


def isolated(spec: ModelSpec) -> bool:
    """True when the model's config asks for process isolation; ConfigError for a value kiln does not know."""
    mode = spec.parameters.get(ISOLATION, "").strip().lower() or "none"
    if mode not in _MODES:
        raise ConfigError(f"model '{spec.name}': parameter {ISOLATION} is '{mode}'; expected one of "
                          f"{', '.join(_MODES)}")
    return mode == "process"


def _max_restarts(spec: ModelSpec) -> int:
    value = spec.parameters.get(MAX_RESTARTS, "").strip()
    if not value:
        return DEFAULT_MAX_RESTARTS
    if not value.isdigit():
        raise ConfigError(f"model '{spec.name}': parameter {MAX_RESTARTS} is '{value}'; expected a whole number "
                          f"of restarts (0 or more)")
    return int(value)


class _Child:
    """One running child process and the connection to it."""

    def __init__(self, spec: ModelSpec, model_file: Path, options: EngineOptions) -> None:
        self.name = spec.name
        ours, theirs = socket.socketpair()
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kiln.engines.python.child", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=_child_environment())
        self.connection = Connection(ours.detach())
        self.pid = self.process.pid
        try:
            self.connection.send((spec, model_file, dataclasses.replace(options, caller=None)))
            reply = self.connection.recv()
        except (EOFError, OSError):
            raise UnavailableError(f"model '{self.name}': its instance process (pid {self.pid}) "
                                   f"{self.ended()} while loading model.py") from None
        if reply[0] != "ready":
            self.ended()
            raise _error(reply)

    def run(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        """The batch's outputs; EOFError/OSError when the child died meanwhile."""
        self.connection.send(("execute", dict(inputs), list(outputs)))
        reply = self.connection.recv()
        if reply[0] == "ok":
            result: dict[str, Array] = reply[1]
            return result
        raise _error(reply)

    def ended(self) -> str:
        """Wait for the child to end (kill it when it lingers) and say how it ended."""
        self.connection.close()
        try:
            code = self.process.wait(_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return "closed its connection and was killed"
        if code < 0:
            return f"was killed by signal {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def close(self) -> None:
        """Ask the child to finalize the model and exit; kill it when it does not within the timeout."""
        try:
            self.connection.send(("close",))
        except OSError:
            pass
        try:
            self.process.wait(_FINALIZE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.error("model '%s': instance process %d did not finalize within %.0fs; killed", self.name,
                      self.pid, _FINALIZE_TIMEOUT_S)
            self.process.kill()
            self.process.wait()
        self.connection.close()


class IsolatedPythonEngine(Engine):
    """A Python model instance in a child process, restarted when it dies (see the module docstring)."""

    thread_safe = False

    def __init__(self, spec: ModelSpec, model_file: Path, options: EngineOptions) -> None:
        super().__init__(spec)
        if spec.config.model_transaction_policy.decoupled:
            raise ConfigError(f"model '{spec.name}': a decoupled model cannot run with {ISOLATION} process; "
                              f"remove the parameter to run it in the server process")
        self.decoupled = False
        self.on_fault: FaultListener | None = None
        self._start = (model_file, options)
        self._max_restarts = _max_restarts(spec)
        self._lock = threading.Lock()
        self._deaths = 0  # in a row; a batch that succeeds resets it
        self._restart_at = 0.0
        self._lost: str | None = None
        self._closed = False
        self._child: _Child | None = _Child(spec, model_file, options)

    @property
    def pid(self) -> int | None:
        """The running child's process id (None between a death and the restart)."""
        return None if self._child is None else self._child.pid

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        with self._lock:
            child = self._running_child()
            try:
                result = child.run(inputs, outputs)
            except (EOFError, OSError):
                raise self._died(child, "while running a batch (its requests failed)") from None
            self._deaths = 0
            return result

    def _running_child(self) -> _Child:
        if self._closed:
            raise UnavailableError(f"model '{self.spec.name}': the engine is closed")
        if self._lost is not None:
            raise UnavailableError(self._lost)
        if self._child is None:
            time.sleep(max(0.0, self._restart_at - time.monotonic()))
            try:
                self._child = _Child(self.spec, *self._start)
            except UnavailableError as exc:  # the new child died while loading: one more death
                raise self._fault(exc.message) from None
            log.warning("model '%s': instance process restarted (pid %d)", self.spec.name, self._child.pid)
        return self._child

    def _died(self, child: _Child, when: str) -> UnavailableError:
        self._child = None
        return self._fault(f"model '{self.spec.name}': its instance process (pid {child.pid}) {child.ended()} "
                           f"{when}")

    def _fault(self, what: str) -> UnavailableError:
        self._deaths += 1
        if self._deaths > self._max_restarts:
            self._lost = (f"{what}; it died {self._deaths} times in a row, more than {MAX_RESTARTS} "
                          f"({self._max_restarts}) allows, so it is not restarted; load the model again to retry")
            reason, lost = self._lost, True
        else:
            backoff = min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * 2 ** (self._deaths - 1))
            self._restart_at = time.monotonic() + backoff
            reason, lost = (f"{what}; restarting it for the next requests in {backoff:.2f}s (restart "
                            f"{self._deaths} of {self._max_restarts})"), False
        log.error("%s", reason)
        if self.on_fault is not None:
            self.on_fault(reason, lost)
        return UnavailableError(reason)

    def close(self) -> None:
        with self._lock:
            child, self._child, self._closed = self._child, None, True
        if child is not None:
            child.close()


def _error(reply: tuple[Any, ...]) -> KilnError:
    """The error a child answered, with its code."""
    try:
        code = ErrorCode(reply[1])
    except ValueError:
        return InternalError(str(reply[2]))
    return error_for_code(code, str(reply[2]))


def _child_environment() -> dict[str, str]:
    """The server's environment, with this kiln first on the path (a source checkout may not be installed)."""
    environment = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])  # the folder that holds the kiln package
    environment["PYTHONPATH"] = os.pathsep.join(p for p in (root, environment.get("PYTHONPATH")) if p)
    return environment
