"""Accuracy and speed of a built engine against its reference, on the same inputs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kiln.build.calibration import Samples, batches, sample_count
from kiln.engines.base import Array, Engine
from kiln.errors import InvalidArgumentError
from kiln.tensor import DataType

_BF16 = DataType.BF16.numpy_dtype


@dataclass(frozen=True)
class Tolerances:
    """Pass criteria: every element within ``atol + rtol * |reference|`` (numpy.allclose), top-1 agreement of
    classifier outputs at least ``min_top1``, and, for outputs no other criterion covers, a normalized RMS error
    (RMS of the difference / standard deviation of the reference) of at most ``max_nrmse``. None skips a criterion.
    A non-finite value where the reference is finite always fails."""

    atol: float | None
    rtol: float | None
    min_top1: float | None
    max_nrmse: float | None = None


# INT8 changes every value a little by design: it is judged by top-1 agreement, unless the caller asks otherwise.
DEFAULT_TOLERANCES = {
    "fp32": Tolerances(atol=1e-4, rtol=1e-3, min_top1=0.99),
    "fp16": Tolerances(atol=1e-2, rtol=1e-2, min_top1=0.99),
    "bf16": Tolerances(atol=5e-2, rtol=5e-2, min_top1=0.98),
    "int8": Tolerances(atol=None, rtol=None, min_top1=0.95, max_nrmse=0.1),
}


@dataclass(frozen=True)
class OutputAccuracy:
    name: str
    max_abs_error: float
    max_rel_error: float
    allclose: bool | None
    top1_agreement: float | None
    nrmse: float = 0.0
    non_finite: int = 0


@dataclass(frozen=True)
class Accuracy:
    samples: int
    tolerances: Tolerances
    outputs: list[OutputAccuracy] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict[str, object]:
        return {"samples": self.samples, "passed": self.passed, "tolerances": asdict(self.tolerances),
                "outputs": [asdict(o) for o in self.outputs], "failures": self.failures}


@dataclass(frozen=True)
class Timing:
    batch_size: int
    reference_ms: float
    built_ms: float

    @property
    def speedup(self) -> float:
        return self.reference_ms / self.built_ms if self.built_ms > 0 else float("inf")

    def as_dict(self) -> dict[str, object]:
        return {"batch_size": self.batch_size, "reference_ms": round(self.reference_ms, 4),
                "built_ms": round(self.built_ms, 4), "speedup": round(self.speedup, 3),
                "reference_items_per_s": round(1000 * self.batch_size / self.reference_ms, 1),
                "built_items_per_s": round(1000 * self.batch_size / self.built_ms, 1)}


def compare(reference: Engine, built: Engine, samples: Samples, batch_size: int,
            tolerances: Tolerances) -> Accuracy:
    """Run both engines on every sample (in batches) and compare output by output."""
    names = [t.name for t in reference.outputs]
    ref_parts: dict[str, list[Array]] = {n: [] for n in names}
    built_parts: dict[str, list[Array]] = {n: [] for n in names}
    for feed in batches(samples, batch_size):
        for name, value in reference.infer(feed, names).items():
            ref_parts[name].append(np.asarray(value))
        for name, value in built.infer(feed_for(built, feed), names).items():
            built_parts[name].append(_widened(np.asarray(value)))
    results = [_output_accuracy(n, np.concatenate(ref_parts[n]), np.concatenate(built_parts[n]), tolerances)
               for n in names]
    failures = [_failure(r, tolerances) for r in results]
    return Accuracy(samples=sample_count(samples), tolerances=tolerances, outputs=results,
                    failures=[f for f in failures if f])


def time_both(reference: Engine, built: Engine, samples: Samples, batch_size: int, *,
              budget_s: float = 1.0, rounds: int = 3) -> Timing:
    """Median latency of each engine at ``batch_size``. The engines take turns in blocks of calls, a few rounds
    each, so both see the same machine state while neither pays for waking the other's thread pool on every call."""
    batch = _batch_of(samples, batch_size)
    feeds = {id(engine): feed_for(engine, batch) for engine in (reference, built)}
    times: dict[int, list[float]] = {id(reference): [], id(built): []}
    for engine in (reference, built):  # warm up: first runs allocate and pick kernels
        engine.infer(feeds[id(engine)])
        times[id(engine)].append(_time_once(engine, feeds[id(engine)]))
    per_call_s = max(sum(times[id(e)]) for e in (reference, built)) / 1000
    block = max(1, min(50, int(budget_s / (2 * rounds * max(per_call_s, 1e-6)))))
    times = {id(reference): [], id(built): []}
    for _ in range(rounds):
        for engine in (reference, built):
            feed = feeds[id(engine)]
            engine.infer(feed)  # first call after the other engine ran wakes this one's threads: not counted
            times[id(engine)] += [_time_once(engine, feed) for _ in range(block)]
    return Timing(batch_size, statistics.median(times[id(reference)]), statistics.median(times[id(built)]))


def feed_for(engine: Engine, feed: Mapping[str, Array]) -> dict[str, Array]:
    """``feed`` (the FP32 samples) in the floating types the engine's config declares (a build with --io-dtype)."""
    wanted = {t.name: t.datatype.numpy_dtype for t in engine.inputs}
    return {name: array.astype(wanted[name]) if name in wanted and array.dtype != wanted[name]
            and array.dtype.kind == "f" and _floating(wanted[name]) else array for name, array in feed.items()}


def _floating(dtype: np.dtype[Any]) -> bool:
    return dtype.kind == "f" or dtype == _BF16


def _widened(array: Array) -> Array:
    """A half-width floating output as FP32, so accuracy is computed in full precision."""
    return array.astype(np.float32) if array.dtype in (np.float16, _BF16) else array


def _batch_of(samples: Samples, batch_size: int) -> dict[str, Array]:
    count = sample_count(samples)
    if count == 0:
        raise InvalidArgumentError("no samples to time the engines with")
    index = np.arange(batch_size) % count  # repeat samples when there are fewer than the batch size
    return {name: array[index] for name, array in samples.items()}


def _time_once(engine: Engine, feed: Mapping[str, Array]) -> float:
    start = time.perf_counter()
    engine.infer(feed)
    return (time.perf_counter() - start) * 1000


def _output_accuracy(name: str, ref: Array, out: Array, tolerances: Tolerances) -> OutputAccuracy:
    if ref.shape != out.shape:
        return OutputAccuracy(name, float("inf"), float("inf"), False, None)
    if ref.dtype.kind not in "fc":
        equal = bool(np.array_equal(ref, out))
        return OutputAccuracy(name, 0.0 if equal else float("inf"), 0.0 if equal else float("inf"), equal, None)
    ref64, out64 = ref.astype(np.float64), out.astype(np.float64)
    non_finite = int(np.count_nonzero(~np.isfinite(out64) & np.isfinite(ref64)))
    diff = np.abs(ref64 - out64)
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = np.maximum(np.abs(ref64), np.finfo(np.float32).tiny)
    max_rel = float((diff / scale).max()) if diff.size else 0.0
    allclose = None
    if tolerances.atol is not None or tolerances.rtol is not None:
        allclose = bool(np.allclose(out64, ref64, rtol=tolerances.rtol or 0.0, atol=tolerances.atol or 0.0))
    spread = float(ref64.std()) if ref64.size else 0.0
    rms = float(np.sqrt(np.mean(diff ** 2))) if diff.size else 0.0
    nrmse = rms / spread if spread > 0 else (0.0 if rms == 0 else float("inf"))
    return OutputAccuracy(name, max_abs, max_rel, allclose, _top1(ref64, out64), nrmse, non_finite)


def _top1(ref: Array, out: Array) -> float | None:
    """Share of samples whose arg-max class agrees, for classifier-shaped outputs ([batch, classes], classes > 1)."""
    if ref.ndim != 2 or ref.shape[1] < 2 or ref.shape[0] == 0:
        return None
    return float(np.mean(np.argmax(ref, axis=1) == np.argmax(out, axis=1)))


def _failure(result: OutputAccuracy, tolerances: Tolerances) -> str:
    if result.non_finite:
        return f"output '{result.name}': {result.non_finite} value(s) are NaN or infinite where the reference is finite"
    if result.allclose is False:
        return (f"output '{result.name}': max abs error {result.max_abs_error:.3g}, max rel error "
                f"{result.max_rel_error:.3g} exceed atol={tolerances.atol} rtol={tolerances.rtol}")
    if result.top1_agreement is not None and tolerances.min_top1 is not None \
            and result.top1_agreement < tolerances.min_top1:
        return (f"output '{result.name}': top-1 agreement {result.top1_agreement:.1%} is below "
                f"min_top1={tolerances.min_top1:.1%}")
    covered = result.allclose is not None or (result.top1_agreement is not None and tolerances.min_top1 is not None)
    if not covered and tolerances.max_nrmse is not None and not result.nrmse <= tolerances.max_nrmse:
        return (f"output '{result.name}': normalized RMS error {result.nrmse:.3g} exceeds max_nrmse="
                f"{tolerances.max_nrmse} (RMS of the difference / standard deviation of the reference)")
    return ""
