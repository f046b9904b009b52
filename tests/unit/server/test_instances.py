"""Instance groups become engine options; CPU instances share the thread budget."""

from __future__ import annotations

import pytest

from kiln.config import parse_config_text
from kiln.config.spec import ModelSpec
from kiln.config.validate import validate_config
from kiln.server.instances import cpu_thread_share, instance_options

IO = """
backend: "identity" max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


def spec(extra: str) -> ModelSpec:
    return validate_config(parse_config_text(f'name: "m" {IO} {extra}'), "m", "config.pbtxt", None)


def test_groups_expand_per_gpu_and_in_total_for_cpu() -> None:
    options = instance_options(spec("instance_group [ { kind: KIND_GPU count: 2 gpus: [ 0, 1 ] }, "
                                    "{ kind: KIND_CPU count: 3 } ]"), threads=2)
    assert [(o.kind, o.device_id) for o in options] == [("gpu", 0), ("gpu", 0), ("gpu", 1), ("gpu", 1),
                                                         ("cpu", 0), ("cpu", 0), ("cpu", 0)]
    assert [o.intra_op_threads for o in options if o.kind == "cpu"] == [2, 2, 2]


def test_models_with_their_own_thread_count_keep_it() -> None:
    own = spec('instance_group [ { kind: KIND_CPU count: 2 } ] '
               'parameters { key: "intra_op_thread_count" value { string_value: "3" } }')
    assert [o.intra_op_threads for o in instance_options(own, threads=1)] == [None, None]


@pytest.mark.parametrize(("cores", "counts", "expected"), [
    (8, [1], None),          # one instance: the engine may use every core
    (8, [1, 1], 4),          # two models share the machine
    (8, [2, 1, 1], 2),       # four instances
    (2, [2, 2, 2], 1),       # never below one thread
])
def test_cpu_thread_share(cores: int, counts: list[int], expected: int | None) -> None:
    specs = [(spec(f"instance_group [ {{ kind: KIND_CPU count: {c} }} ]"), 1) for c in counts]
    assert cpu_thread_share(cores, specs) == expected


def test_versions_count_as_instances_and_gpu_instances_do_not() -> None:
    cpu = spec("instance_group [ { kind: KIND_CPU count: 1 } ]")
    gpu = spec("instance_group [ { kind: KIND_GPU count: 4 } ]")
    assert cpu_thread_share(6, [(cpu, 3), (gpu, 1)]) == 2


def test_python_models_do_not_take_a_share_of_the_budget() -> None:
    cpu = spec("instance_group [ { kind: KIND_CPU count: 1 } ]")
    python = validate_config(parse_config_text(f'name: "p" {IO.replace("identity", "python")}'), "p",
                             "config.pbtxt", None)
    assert cpu_thread_share(6, [(cpu, 2), (python, 1)]) == 3
