"""EdgeRunner without a cloud: local answers, the policy's reasons, checks at start, local engine failures.
Everything that talks to a cloud runs against a real `kiln serve` in tests/integration/test_edge.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.demo.models import build_mlp
from kiln.edge import EdgeRunner, Policy
from kiln.engines.base import Array, Engine
from kiln.errors import ConfigError, InvalidArgumentError
from kiln.tensor import DataType
from kiln.testing.repo import make_repo, onnx_identity_model


@pytest.fixture(scope="module")
def mlp_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mlp") / "mlp.onnx"
    path.write_bytes(build_mlp().SerializeToString())
    return path


def inputs(rows: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    return {"INPUT0": np.random.default_rng(seed).standard_normal((rows, 64)).astype(np.float32)}


def max_probs(path: Path, x: np.ndarray) -> np.ndarray:
    logits = kiln.load(path).infer({"INPUT0": x})["OUTPUT0"].astype(np.float64)
    exp = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (exp / exp.sum(axis=1, keepdims=True)).max(axis=1)


def test_local_only_answers_locally_and_says_what_it_would_forward(mlp_file: Path) -> None:
    x = inputs()["INPUT0"]
    probs = max_probs(mlp_file, x)
    threshold = float(np.median(probs))
    confident, uncertain = x[probs >= threshold][:1], x[probs < threshold][:1]
    assert len(confident) == 1 and len(uncertain) == 1
    with EdgeRunner(mlp_file, policy=Policy(mode="local-only", max_prob_below=threshold)) as runner:
        kept = runner.infer({"INPUT0": confident})
        flagged = runner.infer({"INPUT0": uncertain})
        assert (kept.source, kept.reasons, kept.flagged) == ("local", [], False)
        assert flagged.source == "local" and flagged.flagged
        assert flagged.reasons == [f"max probability of OUTPUT0 below {threshold} (row 0)"]
        np.testing.assert_array_equal(flagged.outputs["OUTPUT0"], kiln.load(mlp_file).infer(
            {"INPUT0": uncertain})["OUTPUT0"])
        assert flagged.cloud_outputs is None
        assert runner.stats.snapshot()["requests"] == 2 and runner.stats.snapshot()["flagged"] == 1


def test_the_policy_reads_outputs_the_caller_did_not_ask_for(tmp_path: Path) -> None:
    repo = make_repo(tmp_path, two=onnx_identity_model(dims=(3,), count=2))
    policy = Policy(mode="local-only", output="OUTPUT1", max_prob_below=0.5)
    with EdgeRunner(repo / "two", policy=policy) as runner:
        assert runner.version == "1"
        flat = np.zeros((1, 3), dtype=np.float32)
        result = runner.infer({"INPUT0": flat, "INPUT1": flat}, outputs=["OUTPUT0"])
        assert list(result.outputs) == ["OUTPUT0"]
        assert result.local_outputs is not None and set(result.local_outputs) == {"OUTPUT0", "OUTPUT1"}
        assert result.reasons == ["max probability of OUTPUT1 below 0.5 (row 0)"]


def test_bad_inputs_raise_and_are_not_counted(mlp_file: Path) -> None:
    with EdgeRunner(mlp_file, policy=Policy(mode="local-only")) as runner:
        with pytest.raises(InvalidArgumentError, match="INPUT0"):
            runner.infer({"INPUT0": np.zeros((1, 63), dtype=np.float32)})
        assert runner.stats.snapshot()["requests"] == 0


def test_modes_that_forward_need_a_cloud_url(mlp_file: Path) -> None:
    for mode in ("cloud-fallback", "shadow"):
        with pytest.raises(ConfigError, match=f"mode '{mode}' needs a cloud url"):
            EdgeRunner(mlp_file, policy=Policy(mode=mode))


def test_policy_is_checked_against_the_model_at_start(mlp_file: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="output 'PROBS' is not an output of model 'mlp'"):
        EdgeRunner(mlp_file, policy=Policy(mode="local-only", output="PROBS"))
    with pytest.raises(ConfigError, match="input_bounds names 'IMAGE'"):
        EdgeRunner(mlp_file, policy=Policy(mode="local-only", input_bounds={"IMAGE": (0.0, 1.0)}))
    repo = make_repo(tmp_path, ints=onnx_identity_model(DataType.INT32, dims=(4,)))
    with pytest.raises(ConfigError, match="no 2-D float output"):
        EdgeRunner(repo / "ints", policy=Policy(mode="local-only", entropy_above=1.0))


class FailsOnNaN(Engine):
    """A real engine that fails the way a backend does when its input breaks it."""

    thread_safe = True

    def __init__(self, inner: Engine) -> None:
        super().__init__(inner.spec)
        self.inner = inner

    def execute(self, inputs: Mapping[str, Array], outputs: Sequence[str]) -> dict[str, Array]:
        if any(np.isnan(array).any() for array in inputs.values()):
            raise RuntimeError("NaN in the input")
        return self.inner.execute(inputs, outputs)


def test_local_failure_without_a_cloud_fails_the_request(mlp_file: Path) -> None:
    with EdgeRunner(FailsOnNaN(kiln.load(mlp_file)), policy=Policy(mode="local-only")) as runner:
        assert runner.infer(inputs(2)).source == "local"
        bad = inputs(2)
        bad["INPUT0"][1, 3] = np.nan
        with pytest.raises(RuntimeError, match="NaN in the input"):
            runner.infer(bad)
        assert runner.stats.snapshot()["local_failures"] == 1


def test_shadow_settings_must_be_positive(mlp_file: Path) -> None:
    with pytest.raises(ConfigError, match="shadow_workers"):
        EdgeRunner(mlp_file, policy=Policy(mode="local-only"), shadow_queue=0)


def test_a_bad_cloud_url_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cloud url 'ftp://cloud:21'"):
        EdgeRunner(tmp_path / "absent.onnx", "ftp://cloud:21", Policy())
