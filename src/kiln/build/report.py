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
        lines += [f"  warning: {warning}" for warning in self.warnings]
        return "\n".join(lines)


class VerificationError(InvalidArgumentError):
    """The built engine missed a tolerance; nothing was added to the repository."""

    def __init__(self, message: str, report: BuildReport) -> None:
        super().__init__(message)
        self.report = report
