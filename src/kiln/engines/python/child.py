"""The process an isolated Python model instance runs in (``python -m kiln.engines.python.child FD``).

It inherits one end of a socket pair as file descriptor FD and speaks :mod:`multiprocessing.connection`'s framed
pickles over it. The first message is ``(spec, model_file, options)``; the child builds an in-process
:class:`~kiln.engines.python.engine.PythonEngine` from it (so ``initialize``, ``execute``, ``finalize`` and the
checks on what the model returns are the same code as without isolation) and answers ``("ready", pid)`` or
``("error", code, message)``. Then each ``("execute", inputs, outputs)`` is answered ``("ok", outputs)`` or
``("error", code, message)``, until ``("close",)`` or the parent's end closing (a server that was killed), which
finalizes the model.
"""

from __future__ import annotations

import os
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any

from kiln.engines.base import EngineOptions
from kiln.errors import InternalError, KilnError, UnsupportedError
from kiln.v2.types import InferRequest, InferResponse


class _NoCalls:
    """The BLS caller of an isolated model: it has no server to call into."""

    def __init__(self, model: str) -> None:
        self._model = model

    def infer_sync(self, request: InferRequest) -> InferResponse:
        raise UnsupportedError(f"model '{self._model}' runs in its own process (parameter "
                               f"KILN_EXECUTION_ISOLATION: process), where calling model '{request.model_name}' "
                               f"(BLS) is not available; remove the parameter to run it in the server process")


def _error(exc: BaseException) -> tuple[str, str, str]:
    if isinstance(exc, KilnError):
        return ("error", exc.code.value, exc.message)
    return ("error", InternalError.code.value, f"{type(exc).__name__}: {exc}")


def serve(connection: Connection) -> None:
    from kiln.engines.python.engine import PythonEngine

    spec, model_file, options = connection.recv()
    options = EngineOptions(kind=options.kind, device_id=options.device_id, extra=options.extra,
                            caller=_NoCalls(spec.name))
    try:
        engine = PythonEngine(spec, model_file, options)
    except BaseException as exc:
        connection.send(_error(exc))
        return
    connection.send(("ready", os.getpid()))
    try:
        while True:
            try:
                message: tuple[Any, ...] = connection.recv()
            except EOFError:  # the server went away: finalize and leave
                return
            if message[0] == "close":
                return
            try:
                connection.send(("ok", engine.execute(message[1], message[2])))
            except Exception as exc:
                connection.send(_error(exc))
    finally:
        engine.close()


def main() -> None:
    # Ctrl-C in a terminal reaches the whole process group: the server drains and then closes this process, so a
    # batch in flight here is not cut short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    connection = Connection(int(sys.argv[1]))
    try:
        serve(connection)
    finally:
        connection.close()


if __name__ == "__main__":
    main()
