"""build_report.json: what a build did, how long each step took, how accurate and how fast the result is."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.build.verify import Accuracy, Timing
from kiln.errors import InvalidArgumentError

REPORT_FILENAME = "build_report.json"


@dataclass
class BuildReport:
    model: str
    source: str
    output: str
    version: int
    backend: str
    precision: str
    steps: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    timings_s: dict[str, float] = field(default_factory=dict)
    accuracy: Accuracy | None = None
    speed: list[Timing] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.accuracy is None or self.accuracy.passed

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "source": self.source, "output": self.output, "version": self.version,
            "backend": self.backend, "precision": self.precision, "passed": self.passed, "steps": self.steps,
            "details": self.details, "warnings": self.warnings, "timings_s": self.timings_s,
            "accuracy": self.accuracy.as_dict() if self.accuracy else None,
            "speed": [t.as_dict() for t in self.speed],
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.as_dict(), indent=2) + "\n")

    def summary(self) -> str:
        """A few lines for the terminal."""
        lines = [f"{'built' if self.passed else 'FAILED'}: {self.model} version {self.version} "
                 f"({self.backend}, {self.precision}) -> {self.output}"]
        if self.accuracy is not None:
            for out in self.accuracy.outputs:
                top1 = f", top-1 agreement {out.top1_agreement:.1%}" if out.top1_agreement is not None else ""
                lines.append(f"  accuracy {out.name}: max abs {out.max_abs_error:.3g}, max rel "
                             f"{out.max_rel_error:.3g}, normalized RMS {out.nrmse:.3g}{top1} "
                             f"({self.accuracy.samples} samples)")
            lines += [f"  failed: {failure}" for failure in self.accuracy.failures]
        for timing in self.speed:
            lines.append(f"  batch {timing.batch_size}: reference {timing.reference_ms:.3f} ms, built "
                         f"{timing.built_ms:.3f} ms ({timing.speedup:.2f}x)")
        lines += _compile_lines(self.details.get("compile"))
        lines += _gpu_limit_lines(self.details.get("gpu_limit"))
        lines += [f"  warning: {warning}" for warning in self.warnings]
        return "\n".join(lines)


class VerificationError(InvalidArgumentError):
    """The built engine missed a tolerance; nothing was added to the repository."""

    def __init__(self, message: str, report: BuildReport) -> None:
        super().__init__(message)
        self.report = report


_LOADS = {"eager": "eager", "compiled_cold": "compiled, cold", "compiled_cached": "compiled, from compile_cache.bin "
          "in a fresh process"}


def _compile_lines(details: dict[str, Any] | None) -> list[str]:
    """torch.compile's part (torch backend): the mode, why, the candidates' timings and the load times."""
    if not details:
        return []
    why = f" ({details['requested']}: {details['decided_by']})" if "decided_by" in details else ""
    lines = [f"  compile mode: {details['mode']}{why}"]
    for timing in details.get("timings", []):
        lines.append(f"    batch {timing['batch_size']}: eager {timing['eager_ms']:.3f} ms, compiled "
                     f"{timing['compiled_ms']:.3f} ms ({timing['speedup']:.2f}x)")
    loads = details.get("load_s", {})
    if loads:
        lines.append("  load: " + "; ".join(f"{_LOADS.get(k, k)} {v:.1f} s" for k, v in loads.items()))
    return lines


def _gpu_limit_lines(details: dict[str, Any] | None) -> list[str]:
    if not details:
        return []
    if "skipped" in details:  # said in the report; on the terminal only for GPU builds
        return [] if details["skipped"].startswith("a CPU build") else [f"  GPU limit: not measured "
                                                                        f"({details['skipped']})"]
    by_batch: dict[int, list[str]] = {}
    for figure in details["figures"]:
        streams = f"{figure['streams']} stream{'s' if figure['streams'] > 1 else ''}"
        by_batch.setdefault(figure["batch_size"], []).append(f"{streams} {figure['rows_per_s']:,.0f}")
    listed = "; ".join(f"batch {batch}: {', '.join(parts)}" for batch, parts in by_batch.items())
    return [f"  GPU limit (rows/s, graphs with their copies, no server): {listed}"]
