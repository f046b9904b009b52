"""Shadow traffic over a real Server: versions 1 and 3 answer alike, version 2 doubles the answer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from prometheus_client.parser import text_string_to_metric_families

from kiln.frontends.metrics import MetricsOptions, metrics_registry, render_metrics
from kiln.server import InferRequest, InputTensor, Server, ServerOptions
from kiln.server.shadow import Shadow, ShadowStats, compare_arrays
from kiln.tensor import DataType
from kiln.testing import IR_VERSION, OPSET, write_model

SCALES = {1: 1.0, 2: 2.0, 3: 1.0}


def scale_model(scale: float) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 4])
    k = helper.make_tensor("k", TensorProto.FLOAT, [], [scale])
    graph = helper.make_graph([helper.make_node("Mul", ["INPUT0", "k"], ["OUTPUT0"])], "scale", [x], [y], [k])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    return model


def config(**parameters: str) -> str:
    lines = [f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}' for k, v in parameters.items()]
    return "\n".join(['name: "ab"', 'backend: "onnxruntime"', "max_batch_size: 8",
                      "version_policy { specific { versions: [1, 2, 3] } }", *lines]) + "\n"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    text = config(**{"kiln.ab.weights": "1:1", "kiln.shadow.version": "3", "kiln.shadow.fraction": "1"})
    for version, scale in SCALES.items():
        write_model(tmp_path, "ab", scale_model(scale), text, versions=(version,))
    server = Server(ServerOptions(repositories=[tmp_path]))
    assert server.start() == []
    yield server
    server.close()


def request(rows: int = 1, version: str = "") -> InferRequest:
    x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
    return InferRequest("ab", [InputTensor("INPUT0", DataType.FP32, x.shape, x)], model_version=version)


def settled(server: Server, mirrored: int, timeout_s: float = 10.0) -> ShadowStats:
    """The shadow stats once ``mirrored`` mirrors finished (they run after the primary answers)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.routing("ab").shadow
        assert stats is not None
        if stats.mirrored + stats.skipped >= mirrored and stats.inflight == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


def version_count(server: Server, version: str) -> int:
    return next(s.inference_count for s in server.model_statistics("ab") if s.version == version)


def test_mirrors_of_async_requests_agree_with_an_equal_version(server: Server) -> None:
    async def run() -> list[str]:
        responses = [await server.infer(request(rows=2)) for _ in range(20)]
        await asyncio.sleep(0)  # let the mirror tasks start before the loop closes
        while server.routing("ab").shadow.inflight:  # type: ignore[union-attr]
            await asyncio.sleep(0.01)
        return [r.model_version for r in responses]

    assert set(asyncio.run(run())) == {"1"}
    stats = settled(server, 20)
    assert (stats.mirrored, stats.agreed, stats.disagreed, stats.errors, stats.skipped) == (20, 20, 0, 0, 0)
    assert (stats.top1_rows, stats.top1_agreed, stats.max_abs_diff) == (40, 40, 0.0)
    assert version_count(server, "3") == 40  # shadow requests count in the shadow version's statistics


def test_disagreement_is_recorded_and_the_primary_answer_is_untouched(server: Server) -> None:
    server.set_routing("ab", shadow_version="2", shadow_fraction=1.0)
    for _ in range(10):
        response = server.infer_sync(request())
        assert response.model_version == "1"
        np.testing.assert_array_equal(response.outputs[0].data, np.arange(4, dtype=np.float32).reshape(1, 4))
    stats = settled(server, 10)
    assert (stats.version, stats.mirrored, stats.agreed, stats.disagreed) == ("2", 10, 0, 10)
    assert stats.max_abs_diff == 3.0  # 2x - x at x = 3
    assert stats.top1_agreed == stats.top1_rows == 10  # doubling keeps the arg max
    assert version_count(server, "2") == 10


def test_only_the_sampled_fraction_is_mirrored(server: Server) -> None:
    server.set_routing("ab", shadow_fraction=0.25)
    for _ in range(400):
        server.infer_sync(request())
    stats = settled(server, 1)
    assert 40 <= stats.mirrored <= 160 and stats.fraction == 0.25  # 100 expected; 6 sigma is 52


def test_requests_the_shadow_version_served_are_not_mirrored(server: Server) -> None:
    server.infer_sync(request(version="3"))
    server.infer_sync(request(version="2"))  # an explicit version other than the shadow is mirrored
    stats = settled(server, 1)
    assert (stats.mirrored, stats.agreed) == (1, 0)


def test_shadow_to_a_version_that_is_not_loaded_counts_as_skipped(server: Server) -> None:
    server.set_routing("ab", shadow_version="9", shadow_fraction=1.0)
    server.infer_sync(request())
    stats = settled(server, 1)
    assert (stats.version, stats.mirrored, stats.skipped) == ("9", 0, 1)


def test_a_fraction_of_zero_stops_shadow_traffic(server: Server) -> None:
    status = server.set_routing("ab", shadow_fraction=0)
    assert status.shadow is None
    server.infer_sync(request())
    assert version_count(server, "3") == 0


def test_a_saturated_shadow_skips_and_counts() -> None:
    pool = ThreadPoolExecutor(max_workers=1)
    shadow = Shadow("m", 2, 1.0, 1e-3, 1e-3, lambda: pool, max_inflight=1)
    try:
        assert shadow.sample() is True  # takes the only slot
        assert shadow.sample() is False  # saturated
        shadow.skip()  # releases the slot (the version could not take the request)
        assert shadow.sample() is True
        stats = shadow.stats()
        assert (stats.inflight, stats.skipped) == (1, 2)
    finally:
        pool.shutdown()


def test_a_failing_mirror_counts_as_an_error() -> None:
    pool = ThreadPoolExecutor(max_workers=1)
    shadow = Shadow("m", 2, 1.0, 1e-3, 1e-3, lambda: pool)

    def fail() -> None:
        raise RuntimeError("the shadow version broke")

    assert shadow.sample()
    shadow.start_sync(fail, [])  # type: ignore[arg-type]
    pool.shutdown(wait=True)
    stats = shadow.stats()
    assert (stats.mirrored, stats.errors, stats.inflight) == (1, 1, 0)


# -- comparison -----------------------------------------------------------------------------------------------------


def test_float_outputs_agree_within_tolerance() -> None:
    a = np.array([[0.1, 0.9], [0.8, 0.2]], dtype=np.float32)
    result = compare_arrays({"y": a}, {"y": a + 5e-4}, atol=1e-3, rtol=0)
    assert result.agreed and result.max_abs_diff == pytest.approx(5e-4, rel=1e-3)
    assert (result.top1_rows, result.top1_agreed) == (2, 2)
    assert not compare_arrays({"y": a}, {"y": a + 5e-3}, atol=1e-3, rtol=0).agreed


def test_top1_is_counted_per_row_even_when_values_disagree() -> None:
    a = np.array([[0.1, 0.9], [0.8, 0.2]], dtype=np.float32)
    b = np.array([[0.2, 0.8], [0.3, 0.7]], dtype=np.float32)
    result = compare_arrays({"y": a}, {"y": b}, atol=1e-3, rtol=1e-3)
    assert not result.agreed and (result.top1_rows, result.top1_agreed) == (2, 1)


def test_bfloat16_compares_as_float_and_integers_exactly() -> None:
    h = np.array([1.0, 2.0], dtype=ml_dtypes.bfloat16)
    assert compare_arrays({"h": h}, {"h": h}, 1e-3, 1e-3).agreed
    i = np.array([1, 2], dtype=np.int32)
    assert compare_arrays({"i": i}, {"i": i.copy()}, 1e-3, 1e-3).agreed
    assert not compare_arrays({"i": i}, {"i": i + 1}, 10, 10).agreed


def test_a_missing_or_reshaped_output_disagrees() -> None:
    a = np.zeros((1, 4), dtype=np.float32)
    assert not compare_arrays({"y": a}, {}, 1e-3, 1e-3).agreed
    assert not compare_arrays({"y": a}, {"y": a.reshape(4, 1)}, 1e-3, 1e-3).agreed


def test_shadow_statistics_list_models_that_mirror(server: Server) -> None:
    server.infer_sync(request())
    settled(server, 1)
    [(model, stats)] = server.shadow_statistics()
    assert (model, stats.version, stats.agreed) == ("ab", "3", 1)
    scrape = render_metrics(metrics_registry(server, MetricsOptions(cpu_metrics=False, gpu_metrics=False)))
    samples = {s.labels["result"]: s.value for family in text_string_to_metric_families(scrape.decode())
               if family.name == "kiln_shadow_requests" for s in family.samples}
    assert samples == {"agreed": 1, "disagreed": 0, "error": 0, "skipped": 0}
    assert b"# TYPE kiln_shadow_requests counter" in scrape
    server.set_routing("ab", shadow_fraction=0)
    assert server.shadow_statistics() == []
