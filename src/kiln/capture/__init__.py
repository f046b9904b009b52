"""Samples edges captured for retraining, after kiln serve stored them (--capture-dir): export for training."""

from __future__ import annotations

from kiln.capture.export import export_samples, index_path

__all__ = ["export_samples", "index_path"]
