"""Queue policy of a dynamic batcher, read once from the model's ``dynamic_batching`` config."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.errors import InvalidArgumentError
from kiln.v2._generated import model_config_pb2 as pb
from kiln.v2.types import InferRequest


@dataclass(frozen=True)
class QueuePolicy:
    timeout_us: int = 0  # 0 = no timeout
    delay_on_timeout: bool = False  # timeout_action DELAY instead of REJECT
    allow_timeout_override: bool = False
    max_queue_size: int = 0  # 0 = unbounded

    @classmethod
    def from_config(cls, policy: pb.ModelQueuePolicy) -> QueuePolicy:
        return cls(timeout_us=policy.default_timeout_microseconds,
                   delay_on_timeout=policy.timeout_action == pb.ModelQueuePolicy.DELAY,
                   allow_timeout_override=policy.allow_timeout_override,
                   max_queue_size=policy.max_queue_size)


@dataclass(frozen=True)
class BatchingPolicy:
    """``dynamic_batching`` as the batcher uses it. Priority level 1 is the highest."""

    max_batch_size: int
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_ns: int = 0
    preserve_ordering: bool = False
    priority_levels: int = 1
    default_priority: int = 1
    queue_policies: dict[int, QueuePolicy] = field(default_factory=dict)
    # Wait max_queue_delay only for company seen before: while the queued rows are fewer than the last batch's, other
    # callers are likely to come back; a lone caller never waits. The direct engine's rule; the server keeps
    # Triton's (every batch below its preferred size waits the delay).
    delay_needs_company: bool = False

    @classmethod
    def from_config(cls, config: pb.ModelConfig) -> BatchingPolicy:
        batching = config.dynamic_batching
        levels = max(1, batching.priority_levels)
        default = batching.default_priority_level if batching.priority_levels else 1
        base = QueuePolicy.from_config(batching.default_queue_policy)
        policies = {level: QueuePolicy.from_config(batching.priority_queue_policy[level])
                    if level in batching.priority_queue_policy else base for level in range(1, levels + 1)}
        return cls(max_batch_size=max(1, config.max_batch_size),
                   preferred_batch_sizes=tuple(sorted(set(batching.preferred_batch_size))),
                   max_queue_delay_ns=batching.max_queue_delay_microseconds * 1000,
                   preserve_ordering=batching.preserve_ordering, priority_levels=levels,
                   default_priority=default, queue_policies=policies)

    def queue_policy(self, level: int) -> QueuePolicy:
        return self.queue_policies.get(level) or QueuePolicy()

    def priority_of(self, model: str, request: InferRequest) -> int:
        value = request.parameters.get("priority", 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgumentError(f"model '{model}': request parameter 'priority' is {value!r}; expected an "
                                       f"integer 0..{self.priority_levels} (0 = the default level)")
        if value == 0:
            return self.default_priority
        if value > self.priority_levels:
            raise InvalidArgumentError(f"model '{model}': request parameter 'priority' is {value}; this model "
                                       f"has priority levels 1..{self.priority_levels}")
        return value

    def timeout_us_of(self, model: str, request: InferRequest, priority: int) -> int:
        policy = self.queue_policy(priority)
        value = request.parameters.get("timeout", None)
        if value is None:
            return policy.timeout_us
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgumentError(f"model '{model}': request parameter 'timeout' is {value!r}; expected a "
                                       f"non-negative number of microseconds")
        if not policy.allow_timeout_override or value == 0:
            return policy.timeout_us
        # Triton: an override may shorten the configured timeout, never lengthen it.
        return value if policy.timeout_us == 0 else min(value, policy.timeout_us)
