"""Calibration statistics: computed from samples, written and read back, with errors that name the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.edge.calibration import compute_calibration, load_calibration, write_calibration
from kiln.errors import ConfigError


def test_statistics_round_trip_through_the_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    images = rng.normal(3.0, 2.0, size=(200, 2, 2)).astype(np.float32)
    constant = np.ones((200, 3), dtype=np.float32)
    np.savez(tmp_path / "samples.npz", IMAGE=images, FLAGS=constant)
    written = write_calibration(tmp_path / "samples.npz", tmp_path / "stats.npz")
    loaded = load_calibration(tmp_path / "stats.npz")
    assert set(loaded.inputs) == {"IMAGE", "FLAGS"}
    image = loaded.inputs["IMAGE"]
    assert image.mean.shape == (4,)  # features are the flattened sample dims
    np.testing.assert_allclose(image.mean, images.reshape(200, -1).mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(image.maximum, written.inputs["IMAGE"].maximum)
    assert np.all(loaded.inputs["FLAGS"].std > 0)  # a constant feature keeps a finite z-score


def test_too_few_samples_and_bad_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least 2 samples"):
        compute_calibration({"X": np.zeros((1, 4))})
    with pytest.raises(ConfigError, match="no arrays"):
        compute_calibration({})
    np.savez(tmp_path / "partial.npz", **{"X.mean": np.zeros(2)})
    with pytest.raises(ConfigError, match="input 'X' lacks std, min, max"):
        load_calibration(tmp_path / "partial.npz")
    with pytest.raises(ConfigError, match="missing.npz"):
        write_calibration(tmp_path / "missing.npz", tmp_path / "out.npz")
