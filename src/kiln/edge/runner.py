"""The edge runner: the model runs in-process; the routing policy decides which requests the cloud sees.

What a forwarded request becomes depends on the policy's mode:

* ``local-only``: the local answer, always; the reasons still say what would have been forwarded.
* ``cloud-fallback``: the cloud's answer; when the cloud cannot be reached or answers with an error, the local
  answer, and the source says so. A request never fails because the cloud is down.
* ``shadow``: the local answer at once; a copy goes to the cloud in the background (a bounded pool; when its
  queue is full the copy is dropped and counted).

When the local engine fails, ``cloud-fallback`` and ``shadow`` ask the cloud for the answer (unless the policy's
``forward_on_error`` is off); with no answer from there either, the request fails with UnavailableError.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy.typing as npt

import kiln
from kiln.config.model_dir import open_model_dir
from kiln.edge.cloud import ANSWERED, FAILED, UNREACHABLE, CloudClient, CloudResult, parse_url
from kiln.edge.counters import Counters
from kiln.edge.policy import CLOUD_FALLBACK, LOCAL_ONLY, SHADOW, Decision, Policy, decide
from kiln.engines.base import Engine
from kiln.engines.checks import check_inputs, check_outputs
from kiln.errors import ConfigError, UnavailableError

Array = npt.NDArray[Any]
log = logging.getLogger("kiln.edge")
# (inputs, local outputs or None, cloud outputs or None, reasons, source of the answer)
ForwardedHook = Callable[[Mapping[str, Array], "dict[str, Array] | None", "dict[str, Array] | None", list[str], str],
                         None]

LOCAL = "local"
CLOUD = "cloud"
LOCAL_CLOUD_UNREACHABLE = "local (cloud unreachable)"
LOCAL_CLOUD_ERROR = "local (cloud error)"
SOURCES = (LOCAL, CLOUD, LOCAL_CLOUD_UNREACHABLE, LOCAL_CLOUD_ERROR)


@dataclass(frozen=True)
class EdgeResult:
    """One answer. ``reasons`` (why the request went toward the cloud) is empty when the policy kept it local;
    ``cloud_error`` says why the cloud did not answer when the source is a local fallback."""

    outputs: dict[str, Array]
    source: str
    reasons: list[str]
    local_outputs: dict[str, Array] | None = None
    cloud_outputs: dict[str, Array] | None = None
    cloud_error: str = ""

    @property
    def flagged(self) -> bool:
        """True when the policy asked for the cloud (in local-only mode too, where nothing is sent)."""
        return bool(self.reasons)


@dataclass
class EdgeStats(Counters):
    requests: int = 0
    flagged: int = 0  # requests the policy (or a local failure) sent toward the cloud
    cloud_answers: int = 0
    cloud_unreachable: int = 0
    cloud_errors: int = 0
    local_failures: int = 0
    shadow_sent: int = 0
    shadow_failed: int = 0
    shadow_dropped: int = 0


class EdgeRunner:
    """A model answered in-process, with uncertain or out-of-range requests routed to a cloud server.

    ``model`` is a model file or folder (loaded with :func:`kiln.load`) or an engine already loaded.
    ``cloud_url`` is ``host:port`` of a KServe V2 HTTP server serving ``cloud_model`` (default: the same name).
    """

    def __init__(self, model: str | Path | Engine, cloud_url: str | None = None, policy: Policy | None = None, *,
                 cloud_model: str | None = None, cloud_version: str = "", version: int | None = None,
                 cloud_timeout_s: float = 5.0, shadow_workers: int = 2, shadow_queue: int = 64,
                 cloud_api_key: str | None = None, **load_options: Any) -> None:
        self.policy = policy or Policy()
        if shadow_workers < 1 or shadow_queue < 1:
            raise ConfigError(f"edge: shadow_workers ({shadow_workers}) and shadow_queue ({shadow_queue}) must be "
                              f">= 1")
        if self.policy.mode != LOCAL_ONLY and cloud_url is None:
            raise ConfigError(f"edge: mode '{self.policy.mode}' needs a cloud url (or use mode '{LOCAL_ONLY}')")
        if cloud_url is not None:
            parse_url(cloud_url)  # a bad address fails before the model loads
        engine = model if isinstance(model, Engine) else kiln.load(model, version, **load_options)
        try:
            self._slot = _Slot(engine, _served_version(model, version))
            self._check_policy(engine)
        except BaseException:
            if not isinstance(model, Engine):  # an engine passed in stays the caller's to close
                engine.close()
            raise
        self.cloud = None if cloud_url is None else CloudClient(
            cloud_url, cloud_model or engine.name, version=cloud_version, timeout_s=cloud_timeout_s,
            api_key=cloud_api_key)
        self.stats = EdgeStats()
        self._swap = threading.Condition()
        # Called after each local run with (version, succeeded); model sync watches a new version through it.
        self.on_local_result: Callable[[str, bool], None] | None = None
        # Called for each request sent toward the cloud, with what capture keeps: see kiln.edge.capture.
        self.on_forwarded: ForwardedHook | None = None
        self._shadow = concurrent.futures.ThreadPoolExecutor(shadow_workers, thread_name_prefix="kiln-edge-shadow")
        self._shadow_slots = threading.BoundedSemaphore(shadow_queue)

    @property
    def engine(self) -> Engine:
        """The engine serving now (another may replace it: see :meth:`swap_engine`)."""
        return self._slot.engine

    @property
    def version(self) -> str:
        """The version folder the serving engine came from ("" when unknown)."""
        return self._slot.version

    @property
    def name(self) -> str:
        return self.engine.name

    def swap_engine(self, engine: Engine, version: str) -> Engine:
        """Serve ``engine`` from now on and return the previous one once no local run uses it any more; the
        caller closes it (or swaps it back). Requests that started before the swap finish on the previous engine."""
        if engine.name != self.name:
            raise ConfigError(f"edge: cannot swap model '{engine.name}' in for model '{self.name}'")
        self._check_policy(engine)
        with self._swap:
            previous, self._slot = self._slot, _Slot(engine, version)
            self._swap.wait_for(lambda: previous.inflight == 0)
        return previous.engine

    def _check_policy(self, engine: Engine) -> None:
        """Refuse a policy that cannot apply to this model, at start rather than on the first request."""
        outputs = {t.name: t for t in engine.outputs}
        if self.policy.output is not None and self.policy.output not in outputs:
            raise ConfigError(f"edge policy: output '{self.policy.output}' is not an output of model "
                              f"'{engine.name}' (outputs: {', '.join(outputs)})")
        inputs = {t.name for t in engine.inputs}
        unknown = [name for name in self.policy.input_bounds if name not in inputs]
        if unknown:
            raise ConfigError(f"edge policy: input_bounds names '{unknown[0]}', not an input of model "
                              f"'{engine.name}' (inputs: {', '.join(sorted(inputs))})")
        batch = 1 if engine.spec.batching else 0
        classifiers = [t.name for t in engine.outputs
                       if batch + len(t.dims) == 2 and t.datatype.numpy_dtype.kind == "f"]
        if self.policy.checks_uncertainty and self.policy.output is None and not classifiers:
            raise ConfigError(f"edge policy: model '{engine.name}' has no 2-D float output for the uncertainty "
                              f"criteria; name the output to read with 'output'")

    # -- inference -------------------------------------------------------------------------------------------

    def infer(self, inputs: Mapping[str, npt.ArrayLike], outputs: Sequence[str] | None = None) -> EdgeResult:
        """Answer one request. Bad inputs raise InvalidArgumentError (nothing is forwarded for them)."""
        slot = self._enter()
        try:
            arrays = check_inputs(slot.engine.spec, inputs)
            names = check_outputs(slot.engine.spec, outputs)
            self.stats.add(requests=1)
            local = _run_or_error(slot, arrays)
        finally:
            self._leave(slot)
        self._report(slot.version, not isinstance(local, Exception))
        if isinstance(local, Exception):
            return self._on_local_failure(arrays, names, local)
        decision = decide(self.policy, arrays, local)
        answer = {name: local[name] for name in names}
        if decision.forward:
            self.stats.add(flagged=1)
        if not decision.forward or self.policy.mode == LOCAL_ONLY:
            return EdgeResult(answer, LOCAL, decision.reasons, local)
        if self.policy.mode == SHADOW:
            self._send_copy(arrays, local, decision.reasons)
            return EdgeResult(answer, LOCAL, decision.reasons, local)
        result = self._from_cloud(arrays, names, decision, local)
        self._forwarded(arrays, local, result.cloud_outputs, result.reasons, result.source)
        return result

    def _enter(self) -> _Slot:
        with self._swap:
            slot = self._slot
            slot.inflight += 1
            return slot

    def _leave(self, slot: _Slot) -> None:
        with self._swap:
            slot.inflight -= 1
            self._swap.notify_all()

    def _report(self, version: str, ok: bool) -> None:
        hook = self.on_local_result
        if hook is not None:
            hook(version, ok)

    def _from_cloud(self, arrays: Mapping[str, Array], names: Sequence[str], decision: Decision,
                    local: dict[str, Array]) -> EdgeResult:
        assert self.policy.mode == CLOUD_FALLBACK
        result = self._ask_cloud(arrays, names)
        if not result.ok:
            answer = {name: local[name] for name in names}
            return EdgeResult(answer, _fallback_source(result), decision.reasons, local, cloud_error=result.error)
        cloud = result.outputs or {}
        return EdgeResult({name: cloud[name] for name in names}, CLOUD, decision.reasons, local, cloud)

    def _on_local_failure(self, arrays: Mapping[str, Array], names: Sequence[str], exc: Exception) -> EdgeResult:
        self.stats.add(local_failures=1)
        reason = f"local engine failed: {type(exc).__name__}: {exc}"
        log.warning("model '%s': %s", self.name, reason)
        if self.policy.mode == LOCAL_ONLY or not self.policy.forward_on_error or self.cloud is None:
            raise exc
        self.stats.add(flagged=1)
        result = self._ask_cloud(arrays, names)
        self._forwarded(arrays, None, result.outputs if result.ok else None, [reason],
                        CLOUD if result.ok else _fallback_source(result))
        if not result.ok:
            raise UnavailableError(f"model '{self.name}': {reason}; and the cloud gave no answer: "
                                   f"{result.error}") from exc
        cloud = result.outputs or {}
        return EdgeResult({name: cloud[name] for name in names}, CLOUD, [reason], None, cloud)

    def _ask_cloud(self, arrays: Mapping[str, Array], names: Sequence[str]) -> CloudResult:
        """The cloud's answer; one that lacks an output in ``names`` counts as a cloud error."""
        assert self.cloud is not None
        result = self.cloud.infer(arrays)
        missing = [name for name in names if name not in (result.outputs or {})]
        if result.ok and missing:
            result = CloudResult(FAILED, error=f"{self.cloud.url}{self.cloud.path}: the answer lacks output "
                                               f"'{missing[0]}'")
        if result.status == ANSWERED:
            self.stats.add(cloud_answers=1)
        elif result.status == UNREACHABLE:
            self.stats.add(cloud_unreachable=1)
        else:
            self.stats.add(cloud_errors=1)
        return result

    # -- shadow copies ---------------------------------------------------------------------------------------

    def _send_copy(self, arrays: Mapping[str, Array], local: dict[str, Array], reasons: list[str]) -> None:
        if not self._shadow_slots.acquire(blocking=False):
            self.stats.add(shadow_dropped=1)
            self._forwarded(arrays, local, None, reasons, LOCAL)
            return
        try:
            self._shadow.submit(self._shadow_one, dict(arrays), local, reasons)
        except RuntimeError:  # the runner is closing
            self._shadow_slots.release()
            self.stats.add(shadow_dropped=1)
            self._forwarded(arrays, local, None, reasons, LOCAL)

    def _shadow_one(self, arrays: Mapping[str, Array], local: dict[str, Array], reasons: list[str]) -> None:
        try:
            result = self._ask_cloud(arrays, ())
            self._forwarded(arrays, local, result.outputs if result.ok else None, reasons, LOCAL)
            if result.ok:
                self.stats.add(shadow_sent=1)
            else:
                self.stats.add(shadow_failed=1)
                log.info("model '%s': shadow copy not delivered: %s", self.name, result.error)
        finally:
            self._shadow_slots.release()

    def _forwarded(self, arrays: Mapping[str, Array], local: dict[str, Array] | None,
                   cloud: dict[str, Array] | None, reasons: list[str], source: str) -> None:
        """Hand a forwarded request to the hook; a failing hook is logged and never fails the request."""
        hook = self.on_forwarded
        if hook is None:
            return
        try:
            hook(arrays, local, cloud, reasons, source)
        except Exception:
            log.exception("model '%s': the forwarded-request hook failed", self.name)

    # -- lifecycle -------------------------------------------------------------------------------------------

    def close(self, *, wait_for_copies: bool = True) -> None:
        """Stop the shadow pool (waiting for queued copies unless told not to) and release the engine."""
        self._shadow.shutdown(wait=wait_for_copies, cancel_futures=not wait_for_copies)
        if self.cloud is not None:
            self.cloud.close()
        self.engine.close()

    def __enter__(self) -> EdgeRunner:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class _Slot:
    """An engine with its version, the lock that serializes it when it is not thread-safe, and its local runs in
    flight (a swapped-out engine is handed back only when they are done)."""

    def __init__(self, engine: Engine, version: str) -> None:
        self.engine = engine
        self.version = version
        self.inflight = 0
        self._lock = None if engine.thread_safe else threading.Lock()

    def run(self, arrays: Mapping[str, Array]) -> dict[str, Array]:
        # Every output is computed: the policy may read one the caller did not ask for.
        every = [t.name for t in self.engine.outputs]
        if self._lock is None:
            return self.engine.execute(arrays, every)
        with self._lock:
            return self.engine.execute(arrays, every)


def _run_or_error(slot: _Slot, arrays: Mapping[str, Array]) -> dict[str, Array] | Exception:
    try:
        return slot.run(arrays)
    except Exception as exc:
        return exc


def _fallback_source(result: CloudResult) -> str:
    return LOCAL_CLOUD_UNREACHABLE if result.status == UNREACHABLE else LOCAL_CLOUD_ERROR


def _served_version(model: str | Path | Engine, version: int | None) -> str:
    """The version folder ``kiln.load`` picked ("" for a model file or an engine passed in)."""
    if isinstance(model, Engine) or Path(model).is_file() or version is not None:
        return "" if version is None else str(version)
    served = open_model_dir(Path(model)).served_versions()
    return str(served[-1]) if served else ""

