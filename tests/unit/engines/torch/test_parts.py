"""Several requests' inputs run as one batch (``execute_parts``, what the dynamic batcher calls): the same rows
come back, in order, as running the concatenated batch. On the CPU this is the base class's concatenation; the
GPU tests (test_gpu_lanes.py) check the staged path against it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import kiln

from ._models import TWO_HEADS_IO, X, Y, config, write_model_folder


def test_parts_run_as_one_batch_in_order(tmp_path: Path, files: dict[str, Path]) -> None:
    engine = kiln.load(write_model_folder(tmp_path, "m", config("pytorch_libtorch", *TWO_HEADS_IO), files["script"]))
    parts = [{"x": X[:1], "y": Y[:1]}, {"x": X[1:], "y": Y[1:]}]
    whole = engine.execute({"x": X, "y": Y}, ["OUTPUT__0", "OUTPUT__1"])
    got = engine.execute_parts(parts, ["OUTPUT__0", "OUTPUT__1"])
    assert got.keys() == whole.keys()
    for name in whole:
        np.testing.assert_allclose(got[name], whole[name], rtol=1e-6)
    single = engine.execute_parts(parts[:1], ["OUTPUT__1"])
    assert list(single) == ["OUTPUT__1"]
    np.testing.assert_allclose(single["OUTPUT__1"], whole["OUTPUT__1"][:1], rtol=1e-6)
    engine.close()
