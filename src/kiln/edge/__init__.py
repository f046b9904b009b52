"""The edge: a model answered in-process, with requests the routing policy picks sent to a cloud kiln server.

``EdgeRunner`` is the Python API; ``kiln.edge.http`` serves it over the KServe V2 HTTP infer endpoint.
"""

from __future__ import annotations

from kiln.edge.calibration import CalibrationStats, compute_calibration, load_calibration, write_calibration
from kiln.edge.cloud import CloudClient, CloudResult
from kiln.edge.policy import MODES, Decision, Policy, decide, load_policy, policy_from_dict
from kiln.edge.runner import SOURCES, EdgeResult, EdgeRunner, EdgeStats

__all__ = [
    "MODES",
    "SOURCES",
    "CalibrationStats",
    "CloudClient",
    "CloudResult",
    "Decision",
    "EdgeResult",
    "EdgeRunner",
    "EdgeStats",
    "Policy",
    "compute_calibration",
    "decide",
    "load_calibration",
    "load_policy",
    "policy_from_dict",
    "write_calibration",
]
