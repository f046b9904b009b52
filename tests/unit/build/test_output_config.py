"""The config a build writes: instances and batching by where the engine runs."""

from __future__ import annotations

import pytest

from kiln.build.output import GPU_INSTANCES, gpu_preferred_batch_sizes, make_config
from kiln.config._generated import model_config_pb2 as pb
from kiln.config.onnx_io import FileIO, FileTensor
from kiln.tensor import DataType

IO = FileIO(inputs=(FileTensor("x", DataType.FP32, (-1, 3, 8, 8)),),
            outputs=(FileTensor("y", DataType.FP32, (-1, 10)),))


def test_a_gpu_build_gets_two_instances_and_preferred_sizes_that_split_a_full_queue() -> None:
    config = make_config("m", "pytorch", "", IO, 64, gpu=True, parameters={})
    (group,) = config.instance_group
    assert group.kind == pb.ModelInstanceGroup.KIND_GPU
    assert group.count == GPU_INSTANCES == 2
    assert list(config.dynamic_batching.preferred_batch_size) == [16, 32]
    assert config.dynamic_batching.max_queue_delay_microseconds == 0


def test_a_cpu_build_keeps_one_instance_and_plain_dynamic_batching() -> None:
    config = make_config("m", "onnxruntime", "", IO, 64, gpu=False, parameters={})
    (group,) = config.instance_group
    assert (group.kind, group.count) == (pb.ModelInstanceGroup.KIND_CPU, 1)
    assert config.HasField("dynamic_batching")
    assert not config.dynamic_batching.preferred_batch_size


@pytest.mark.parametrize(("max_batch", "preferred"), [(8, [2, 4]), (10, [2, 5]), (64, [16, 32]), (4, []),
                                                      (1, [])])
def test_preferred_sizes_only_when_a_quarter_batch_is_more_than_one_row(max_batch: int,
                                                                       preferred: list[int]) -> None:
    config = make_config("m", "pytorch", "", IO, max_batch, gpu=True, parameters={})
    assert list(config.dynamic_batching.preferred_batch_size) == preferred
    assert config.HasField("dynamic_batching") == (max_batch > 1)


def test_preferred_sizes_are_whole_distinct_and_sorted() -> None:
    assert gpu_preferred_batch_sizes(64) == [16, 32]
    assert gpu_preferred_batch_sizes(2) == [1]
