"""A/B testing of a model's versions: the report on a running server's routing, statistics and shadow traffic,
and the versions' agreement on captured samples."""

from __future__ import annotations

from kiln.ab.agreement import Agreement, CaptureAgreement, capture_agreement
from kiln.ab.report import build_report, print_report

__all__ = ["Agreement", "CaptureAgreement", "build_report", "capture_agreement", "print_report"]
