"""Smoke tests of the benchmarks that measure GPU-shaped work without a GPU (a device stand-in, the lane pool, host
copies), the INT8 build on a shrunken ResNet-50, and shm_gpu.py's served rows against a CPU model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.config import backends
from kiln.demo.resnet import build_resnet50
from kiln.engines import base
from kiln.testing import write_model

from ._smoke import needs_tools, needs_torch, numbers_in_column, read_json, run_main

_TINY_RESNET = """name: "resnet50" platform: "onnxruntime_onnx" max_batch_size: 8
input [ { name: "input" data_type: TYPE_FP32 dims: [ 3, 32, 32 ] } ]
output [ { name: "output" data_type: TYPE_FP32 dims: [ 10 ] } ]
dynamic_batching { }
"""


@needs_torch
def test_scheduler_ceiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The script registers its stand-in backend: keep that out of the other tests' registries.
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.setattr(backends, "BACKENDS", dict(backends.BACKENDS))
    output = tmp_path / "ceiling.json"
    assert run_main("scheduler_ceiling", "--concurrency", "2", "--instances", "1", "--seconds", "0.3", "--dims",
                    "3,8,8", "--max-batch-size", "4", "--output", str(output)) == 0
    rows = read_json(output)["rows"]
    assert [row["path"] for row in rows] == ["workers", "launched"]
    for row in rows:
        assert row["requests_per_s"] > 0 and row["average_batch"] >= 1 and row["device_bound_per_s"] > 0, row


@needs_torch
def test_served_ceiling(tmp_path: Path) -> None:
    output = tmp_path / "served.json"
    assert run_main("served_ceiling", "--rows", "grpc:system shm", "--concurrency", "2",
                    "--client-processes", "1", "--seconds", "0.3", "--instances", "1", "--preferred", "",
                    "--output", str(output)) == 0
    rows = read_json(output)["rows"]
    assert [(row["protocol"], row["tensors"]) for row in rows] == [("grpc", "system shm")]
    assert all(row["requests_per_s"] > 0 and row["average_batch"] >= 1 for row in rows), rows


@needs_torch
def test_served_ceiling_compares_http_worker_counts(tmp_path: Path) -> None:
    output = tmp_path / "served.json"
    assert run_main("served_ceiling", "--rows", "http:request body", "--http-workers", "1,2", "--concurrency", "2",
                    "--client-processes", "1", "--seconds", "0.3", "--instances", "1", "--preferred", "",
                    "--serve-args", "--allow-grpc false", "--output", str(output)) == 0
    rows = read_json(output)["rows"]
    assert [(row["http_workers"], row["protocol"]) for row in rows] == [(1, "http"), (2, "http")]
    assert all(row["requests_per_s"] > 0 and row["average_batch"] >= 1 for row in rows), rows
    one, two = (row["cpu"] for row in rows)  # where the CPU went: with workers, the HTTP work leaves the core process
    assert one["core"] > 0 and 0 < one["busiest_thread"] <= one["core"] + 0.05 and one["workers"] == 0, one
    assert two["workers"] > 0 and 0 < two["busiest_worker"] <= two["workers"] + 0.05, two
    assert 0 <= two["machine_idle"] <= 1, two
    assert one["core_faults_per_request"] >= 0 and one["worker_faults_per_request"] == 0, one
    assert two["worker_faults_per_request"] > 0, two  # a worker's first requests fault its buffers in
    # Without workers nothing is joined: one request per call; with them, at least that.
    assert rows[0]["requests_per_call"] == 1 and rows[1]["requests_per_call"] >= 1, rows


@needs_torch
def test_served_stages_on_the_stand_in(tmp_path: Path) -> None:
    output = tmp_path / "stages.json"
    assert run_main("served_stages", "--stand-in", "--http-workers", "2,1", "--seconds", "0.5", "--output",
                    str(output)) == 0
    with_workers, alone = read_json(output)["scenarios"]
    for scenario in (with_workers, alone):
        steps = {(step["from"], step["to"]): step for step in scenario["steps"]}
        assert scenario["steps"][0]["from"] == "LimitedHttpToolsProtocol.on_message_begin", scenario
        assert scenario["sequence_share"] > 0.5 and scenario["requests"] >= 50, scenario
        # The stand-in's device takes 0.5 ms a batch: the gap the probes put there is that wait.
        device = steps[("LaunchRunner._launch.end", "LaunchRunner.device_done")]
        assert 450 <= device["median_us"] <= 5000 and device["process"] == "server", device
        assert 0 < scenario["traced_us"] <= scenario["cycle_us"] and scenario["outside_us"] > 0, scenario
        assert 0.5 < scenario["cycle_us"] / (1000 * scenario["client_p50_ms"]) < 2, scenario
    processes = {step["process"] for step in with_workers["steps"]}
    assert processes == {"worker", "server"}, with_workers["steps"]
    worker_steps = {(s["from"], s["to"]) for s in with_workers["steps"]}
    assert ("FrameProtocol._write", "FrameProtocol.data_received") in worker_steps
    # the workers answer infer requests on their lane (infer_lane.py), not as ASGI tasks
    assert ("LimitedHttpToolsProtocol.on_message_complete", "InferLane.take") in worker_steps, worker_steps
    assert {step["process"] for step in alone["steps"]} == {"server"}, alone["steps"]


@needs_torch
@needs_tools("wrk")
def test_infer_lane_off_and_on(tmp_path: Path) -> None:
    output = tmp_path / "lane.json"
    assert run_main("infer_lane", "--concurrency", "2", "--rounds", "1", "--seconds", "1", "--warmup", "0",
                    "--output", str(output)) == 0
    rows = read_json(output)["rows"]
    assert [row["lane"] for row in rows] == ["off", "on"]
    for row in rows:
        assert row["rps"] > 0 and row["errors"] == 0 and row["worker_us"] > 0 and row["server_us"] > 0, row
    assert "c=2: req/s" in output.with_suffix(".txt").read_text()


def test_infer_lane_off_and_on_in_the_server_process(tmp_path: Path) -> None:
    output = tmp_path / "lane.json"
    assert run_main("infer_lane", "--http-workers", "1", "--concurrency", "2", "--rounds", "1", "--seconds", "1",
                    "--warmup", "0", "--output", str(output)) == 0
    rows = read_json(output)["rows"]
    assert [row["lane"] for row in rows] == ["off", "on"]
    for row in rows:
        assert row["rps"] > 0 and row["errors"] == 0 and row["worker_us"] == 0 and row["server_us"] > 0, row
    summary = output.with_suffix(".txt").read_text()
    assert "HTTP in the server process" in summary and "server CPU per request" in summary
    assert "worker CPU per request" not in summary


def test_stage_probes_wrap_all_or_none() -> None:
    import _stage_probes

    from kiln.server.infer import InferPath

    admit = InferPath.admit
    with pytest.raises(AttributeError, match="admitted"):
        _stage_probes._wrap_all((("kiln.server.infer", "InferPath", "admit", "span"),
                                 ("kiln.server.infer", "InferPath", "admitted", "span")))
    assert InferPath.admit is admit  # the probe that matched was not installed either


def test_shm_gpu_served_rows_on_a_cpu_model(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "resnet50", build_resnet50(0, base_channels=8, image_size=32, num_classes=10), _TINY_RESNET)
    output = tmp_path / "shm.json"
    assert run_main("shm_gpu", "--repo", str(repo), "--no-direct", "--tensors", "system shm", "--protocols", "http",
                    "--concurrency", "2", "--client-processes", "1", "--seconds", "0.3", "--output",
                    str(output)) == 0
    (row,) = read_json(output)["rows"]
    assert (row["path"], row["tensors"], row["concurrency"]) == ("kiln serve, http", "system shm", 2)
    assert row["requests_per_s"] > 0


@needs_torch
def test_lane_pool(tmp_path: Path) -> None:
    output = tmp_path / "lanes.txt"
    assert run_main("lane_pool", "--lanes", "1", "--threads", "2", "--seconds", "0.2", "--output", str(output)) == 0
    text = output.read_text()
    assert "| 2 | put back |" in text and "| 2 | kiln LanePool |" in text
    assert all(rate > 0 for rate in numbers_in_column(text, 2, "2"))


@needs_torch
def test_staging_copy(tmp_path: Path) -> None:
    output = tmp_path / "staging.txt"
    assert run_main("staging_copy", "--repeats", "1", "--output", str(output)) == 0
    lines = [line for line in output.read_text().splitlines() if "GB/s" in line]
    assert len(lines) == 4 and all("torch.cat" in line and "numpy, 8 threads" in line for line in lines)


def test_build_int8(tmp_path: Path) -> None:
    output = tmp_path / "int8.json"
    assert run_main("build_int8", "--base-channels", "8", "--image-size", "32", "--calibration-samples", "4",
                    "--runs", "2", "--batch-sizes", "1", "--bar", "0", "--min-top1", "0", "--output",
                    str(output)) == 0
    result = read_json(output)
    (row,) = result["rows"]
    assert row["fp32_ms"] > 0 and row["int8_ms"] > 0 and result["passed"] is True
    assert "QLinearConv" in result["report"]["details"]["runtime_ops"]


@needs_torch
def test_handoff_ceiling_runs_each_row_one_by_one_joined_and_held(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.engines.torch import staging

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.setattr(backends, "BACKENDS", dict(backends.BACKENDS))
    fills = _count_fills(monkeypatch, staging)
    output = tmp_path / "handoff.json"
    assert run_main("handoff_ceiling", "--workers", "1", "--concurrency", "8", "--seconds", "0.5",
                    "--output", str(output)) == 0
    rows = read_json(output)["rows"]
    assert [row["mode"] for row in rows] == ["one by one", "joined per turn", "joined, held at once", "joined, held"]
    # The script itself checks the server counted every answer; joined requests form bigger batches.
    assert all(row["requests_per_s"] > 0 and 0 < row["loop_cpu_us"] <= row["server_cpu_us"] for row in rows), rows
    assert min(rows[1]["average_batch"], rows[2]["average_batch"]) > rows[0]["average_batch"], rows
    assert fills  # without --rows-in-place the stand-in stages every batch, as on a CPU


@needs_torch
def test_handoff_ceiling_reads_rows_in_place_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import scheduler_ceiling  # ._smoke puts benchmarks/ on sys.path

    from kiln.engines.torch import staging

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.setattr(backends, "BACKENDS", dict(backends.BACKENDS))
    monkeypatch.setattr(scheduler_ceiling.DeviceStandIn, "in_place", False)  # the script sets it: undone after
    fills = _count_fills(monkeypatch, staging)
    output = tmp_path / "handoff.json"
    assert run_main("handoff_ceiling", "--workers", "1", "--concurrency", "4", "--seconds", "0.3", "--rows-in-place",
                    "--output", str(output)) == 0
    assert all(row["requests_per_s"] > 0 for row in read_json(output)["rows"])
    assert not fills  # the workers' requests lie in their arena, which the server lists: nothing is staged


def _count_fills(monkeypatch: pytest.MonkeyPatch, staging: Any) -> list[int]:
    """How many parts each RowStaging fill from now on copied (in this process: the server side of
    handoff_ceiling)."""
    fills: list[int] = []
    original = staging.RowStaging.fill
    monkeypatch.setattr(staging.RowStaging, "fill", lambda self, arrays: fills.append(len(arrays)) or original(
        self, arrays))
    return fills
