"""The Python backend: a user's model.py, run in-process.

Triton runs each Python model instance in its own stub process and talks to it over shared memory. kiln imports
model.py into the server process instead: no copies and no IPC per request, at the price of sharing the GIL with
the server (the GIL is released by numpy, torch and most native code). Each instance imports model.py afresh, so
instances share no module state, as with Triton's separate processes.

The server hands an engine one batch, already assembled; that batch reaches ``execute`` as ONE request whose
inputs carry the batch dimension first (Triton would pass the batched requests as a list, each with its own batch
dimension). A model written for Triton handles this unchanged, since it must accept any batch size per request.
A decoupled model (decoupled.py) is the exception: the server hands it requests one by one, or a list of whole
requests, each with its own response sender (:meth:`PythonEngine.execute_decoupled`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kiln.config.render import config_to_json
from kiln.config.spec import ModelSpec
from kiln.engines.base import Array, Engine, EngineOptions
from kiln.engines.python import bls
from kiln.engines.python.api import Adapter, KilnAdapter, TritonAdapter, named
from kiln.engines.python.decoupled import DecoupledCall, decoupled_requests
from kiln.engines.python.loader import ModelModule, import_model_file, model_class
from kiln.engines.python.tensors import batch_size, collect_outputs, model_inputs
from kiln.errors import InternalError, KilnError, UnavailableError, UnsupportedError
from kiln.v2._generated import model_config_pb2 as pb

log = logging.getLogger("kiln.engines.python")

# Triton's Python backend parameter for a conda-pack environment; kiln runs models in its own interpreter.
_EXECUTION_ENV = "EXECUTION_ENV_PATH"


class PythonEngine(Engine):
    thread_safe = False  # one execute at a time per instance, as Triton runs one stub process per instance

    def __init__(self, spec: ModelSpec, model_file: Path, options: EngineOptions) -> None:
        super().__init__(spec)
        _check_supported(spec)
        self.decoupled = spec.config.model_transaction_policy.decoupled
        self._lock = threading.Lock()
        self._caller = options.caller
        self._module: ModelModule | None = import_model_file(spec.name, model_file)
        try:
            cls, triton = model_class(spec.name, model_file, self._module.module)
            if self.decoupled and not triton:
                raise UnsupportedError(f"model '{spec.name}': a decoupled model (model_transaction_policy "
                                       f"decoupled: true) is written against Triton's API (class "
                                       f"TritonPythonModel, request.get_response_sender())")
            self._adapter: Adapter = TritonAdapter(spec.name) if triton else KilnAdapter(spec.name)
            self._model: Any = self._call(f"{cls.__name__}()", cls)
            initialize = getattr(self._model, "initialize", None)
            if initialize is not None:
                self._call("initialize()", initialize, initialize_args(spec, model_file, options))
        except BaseException:
            self._module.unload()
            raise

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        if self.decoupled:
            raise UnsupportedError(f"model '{self.spec.name}' is decoupled (it may send any number of responses "
                                   f"per request); serve it with `kiln serve` and stream its requests (gRPC "
                                   f"ModelStreamInfer, HTTP generate_stream)")
        with self._lock:
            self._check_open()
            requests = self._adapter.requests(model_inputs(self.spec, inputs), outputs)
            result = self._run_execute(requests)
            produced = self._adapter.outputs(result, len(requests))
            return collect_outputs(self.spec, produced, outputs, batch_size(self.spec, inputs))

    def execute_decoupled(self, calls: Sequence[DecoupledCall]) -> None:
        """Run ``execute`` on whole requests, each with its own response sender. Responses may still come after
        this returns. If ``execute`` fails, every request it has not ended gets the error and the final flag,
        and the error is raised."""
        with self._lock:
            self._check_open()
            requests, senders = decoupled_requests(self.spec, calls, model_inputs)
            try:
                result = self._run_execute(requests)
                if result is not None:
                    raise InternalError(f"model '{self.spec.name}': execute() returned {type(result).__name__}; a "
                                        f"decoupled model sends responses through request.get_response_sender() "
                                        f"and returns None")
            except KilnError as exc:
                for sender in senders:
                    sender.fail(exc)
                raise

    def _check_open(self) -> None:
        if self._module is None:
            raise UnavailableError(f"model '{self.spec.name}': the engine is closed")

    def _run_execute(self, requests: list[Any]) -> Any:
        with bls.calls_through(self._caller):  # the models it may call, for the length of execute
            result = self._call("execute()", self._model.execute, requests)
            if inspect.iscoroutine(result):  # ``async def execute``, as Triton allows
                result = self._call("execute()", asyncio.run, result)
        return result

    def close(self) -> None:
        with self._lock:
            module, self._module = self._module, None
            if module is None:
                return
            finalize = getattr(self._model, "finalize", None)
            try:
                if finalize is not None:
                    self._call("finalize()", finalize)
            except KilnError as exc:  # unloading goes on; Triton logs a failed finalize, too
                log.error("%s", exc)
            finally:
                self._model = None
                module.unload()

    def _call(self, what: str, function: Any, *args: Any) -> Any:
        """Run the model's code; its failures become errors that name the model and what failed."""
        try:
            return function(*args)
        except KilnError as exc:  # kiln's own errors (e.g. UnsupportedError from pb_utils) keep their code
            renamed = named(exc, self.spec.name)
            if renamed is exc:
                raise
            raise renamed from exc
        except Exception as exc:
            raise InternalError(f"model '{self.spec.name}': model.py {what} raised "
                                f"{type(exc).__name__}: {exc}") from exc


def initialize_args(spec: ModelSpec, model_file: Path, options: EngineOptions) -> dict[str, str]:
    """The ``args`` dict Triton passes to ``initialize``: all values are strings."""
    kind = "GPU" if options.kind == "gpu" else "CPU"
    return {
        "model_config": json.dumps(config_to_json(spec.config)),
        "model_instance_kind": kind,
        "model_instance_name": options.extra.get("instance_name") or _instance_name(spec, options),
        "model_instance_device_id": str(options.device_id if options.kind == "gpu" else 0),
        "model_repository": str(model_file.parent.parent),  # Triton's value: the model's own folder
        "model_version": model_file.parent.name,
        "model_name": spec.name,
    }


def _instance_name(spec: ModelSpec, options: EngineOptions) -> str:
    """Triton names instances ``<group name>_<index>``; an engine does not know its index, so it takes 0."""
    gpu = options.kind == "gpu"
    for group in spec.config.instance_group:
        if (group.kind == pb.ModelInstanceGroup.KIND_GPU) == gpu:
            return f"{group.name}_0"
    return f"{spec.name}_0"


def _check_supported(spec: ModelSpec) -> None:
    if spec.parameters.get(_EXECUTION_ENV):
        log.warning("model '%s': parameter %s is ignored; kiln runs Python models in its own interpreter, so "
                    "install the model's packages there", spec.name, _EXECUTION_ENV)
