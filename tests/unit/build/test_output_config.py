"""The config a build writes: instances and batching by where the engine runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.build.gpu_memory import GpuFootprint, instances_that_fit, measure_footprint
from kiln.build.output import GPU_INSTANCES, gpu_preferred_batch_sizes, make_config
from kiln.config.onnx_io import FileIO, FileTensor
from kiln.tensor import DataType
from kiln.v2._generated import model_config_pb2 as pb

IO = FileIO(inputs=(FileTensor("x", DataType.FP32, (-1, 3, 8, 8)),),
            outputs=(FileTensor("y", DataType.FP32, (-1, 10)),))


def test_a_gpu_build_gets_two_instances_and_preferred_sizes_that_split_a_full_queue() -> None:
    config = make_config("m", "pytorch", "", IO, 64, gpu=True, parameters={})
    (group,) = config.instance_group
    assert group.kind == pb.ModelInstanceGroup.KIND_GPU
    assert group.count == GPU_INSTANCES == 2
    assert list(config.dynamic_batching.preferred_batch_size) == [8, 32]
    assert config.dynamic_batching.max_queue_delay_microseconds == 0


def test_a_cpu_build_keeps_one_instance_and_plain_dynamic_batching() -> None:
    config = make_config("m", "onnxruntime", "", IO, 64, gpu=False, parameters={})
    (group,) = config.instance_group
    assert (group.kind, group.count) == (pb.ModelInstanceGroup.KIND_CPU, 1)
    assert config.HasField("dynamic_batching")
    assert not config.dynamic_batching.preferred_batch_size


@pytest.mark.parametrize(("max_batch", "preferred"), [(16, [2, 8]), (20, [2, 10]), (64, [8, 32]), (15, []),
                                                      (8, []), (1, [])])
def test_preferred_sizes_only_when_an_eighth_of_a_batch_is_more_than_one_row(max_batch: int,
                                                                            preferred: list[int]) -> None:
    config = make_config("m", "pytorch", "", IO, max_batch, gpu=True, parameters={})
    assert list(config.dynamic_batching.preferred_batch_size) == preferred
    assert config.HasField("dynamic_batching") == (max_batch > 1)


def test_preferred_sizes_are_whole_distinct_and_sorted() -> None:
    assert gpu_preferred_batch_sizes(64) == [8, 32]
    assert gpu_preferred_batch_sizes(2) == [1]


GIB = 2**30


@pytest.mark.parametrize(("engine_gib", "total_gib", "fitting"), [
    (8, 141, 2),  # a large GPU takes both instances
    (8, 24, 1),  # two copies would take more than half of a 24 GiB GPU
    (30, 40, 1),  # even one copy crowds it: one instance all the same
    (0, 16, 2),  # nothing measured in PyTorch's pool (a TensorRT engine): the config stays as generated
])
def test_gpu_instances_fit_in_half_the_gpu(engine_gib: float, total_gib: float, fitting: int) -> None:
    footprint = GpuFootprint(engine_bytes=int(engine_gib * GIB), total_bytes=int(total_gib * GIB))
    assert instances_that_fit(footprint, 2) == fitting


def test_nothing_is_measured_without_a_cuda_build() -> None:
    with measure_footprint("cpu") as footprint:
        pass
    assert footprint.engine_bytes is None and instances_that_fit(footprint, 2) == 2


def test_a_generated_config_keeps_the_instances_that_fit(tmp_path: Path) -> None:
    from kiln.build.builder import _fit_instances
    from kiln.build.report import BuildReport
    from kiln.config.parse import config_to_text, parse_config_text

    path = tmp_path / "config.pbtxt"
    path.write_text(config_to_text(make_config("m", "pytorch", "", IO, 64, gpu=True, parameters={})))
    report = BuildReport(model="m", source="m.onnx", output=str(tmp_path), version=1, backend="torch",
                         precision="fp16")
    _fit_instances(path, GpuFootprint(engine_bytes=10 * GIB, total_bytes=16 * GIB), report)
    assert parse_config_text(path.read_text()).instance_group[0].count == 1
    assert report.details["gpu_memory"] == {"engine_mib": 10240.0, "gpu_total_mib": 16384.0, "instances": 1}
    assert "1 GPU instance(s), not 2" in report.warnings[0]
    untouched = path.read_text()
    _fit_instances(path, GpuFootprint(), report)  # not measured: left as it is
    assert path.read_text() == untouched
