"""The demo model repository, built in code (onnx.helper + numpy): what ``kiln serve`` serves by default."""

from __future__ import annotations

from kiln.demo.repository import build_demo_repository

__all__ = ["build_demo_repository"]
