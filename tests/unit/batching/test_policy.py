"""Request parameters priority and timeout against the model's dynamic_batching config."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.batching.policy import BatchingPolicy
from kiln.config import parse_config_text
from kiln.errors import InvalidArgumentError
from kiln.tensor import DataType
from kiln.v2.types import InferRequest, InputTensor

CONFIG = """
max_batch_size: 8
dynamic_batching {
  preferred_batch_size: [ 4, 2 ]
  max_queue_delay_microseconds: 300
  priority_levels: 3
  default_priority_level: 2
  default_queue_policy { default_timeout_microseconds: 1000 allow_timeout_override: true max_queue_size: 5 }
  priority_queue_policy { key: 1 value { default_timeout_microseconds: 0 } }
}
"""


def request(**parameters: object) -> InferRequest:
    data = np.zeros((1, 2), np.float32)
    return InferRequest("m", [InputTensor("x", DataType.FP32, data.shape, data)], parameters=parameters)  # type: ignore[arg-type]


@pytest.fixture
def policy() -> BatchingPolicy:
    return BatchingPolicy.from_config(parse_config_text(CONFIG))


def test_config_fields(policy: BatchingPolicy) -> None:
    assert policy.preferred_batch_sizes == (2, 4)
    assert policy.max_queue_delay_ns == 300_000
    assert (policy.priority_levels, policy.default_priority) == (3, 2)
    assert policy.queue_policies[2].max_queue_size == 5 and policy.queue_policies[1].timeout_us == 0


def test_priority_parameter(policy: BatchingPolicy) -> None:
    assert policy.priority_of("m", request()) == 2
    assert policy.priority_of("m", request(priority=1)) == 1
    with pytest.raises(InvalidArgumentError, match="priority levels 1..3"):
        policy.priority_of("m", request(priority=4))
    with pytest.raises(InvalidArgumentError, match="'priority' is 'high'"):
        policy.priority_of("m", request(priority="high"))


def test_timeout_override_only_shortens(policy: BatchingPolicy) -> None:
    assert policy.timeout_us_of("m", request(), 2) == 1000
    assert policy.timeout_us_of("m", request(timeout=200), 2) == 200
    assert policy.timeout_us_of("m", request(timeout=5000), 2) == 1000
    with pytest.raises(InvalidArgumentError, match="'timeout' is -1"):
        policy.timeout_us_of("m", request(timeout=-1), 2)


def test_timeout_ignored_without_override() -> None:
    policy = BatchingPolicy.from_config(parse_config_text(
        "max_batch_size: 2 dynamic_batching { default_queue_policy { default_timeout_microseconds: 700 } }"))
    assert policy.timeout_us_of("m", request(timeout=5), 1) == 700
