"""Schedulers decide when and on which instance a model's requests run."""

from kiln.batching.dynamic import DynamicBatcher
from kiln.batching.policy import BatchingPolicy
from kiln.server.model import LoadedModel
from kiln.server.scheduler.base import Scheduler
from kiln.server.scheduler.direct import DirectScheduler


def make_scheduler(model: LoadedModel) -> Scheduler:
    """The sequence batcher for sequence_batching, the dynamic batcher for dynamic_batching, else one request at
    a time per instance; decoupled models have their own (server/decoupled.py)."""
    from kiln.server.decoupled import DecoupledScheduler
    from kiln.server.scheduler.sequence import SequenceBatcher

    if model.spec.config.model_transaction_policy.decoupled:
        return DecoupledScheduler(model)

    choice = model.spec.config.WhichOneof("scheduling_choice")  # ensembles get theirs in ensemble/loading.py
    if choice == "sequence_batching":
        return SequenceBatcher(model)
    if choice == "dynamic_batching":
        return DynamicBatcher(model, BatchingPolicy.from_config(model.spec.config))
    return DirectScheduler(model)


__all__ = ["BatchingPolicy", "DirectScheduler", "DynamicBatcher", "Scheduler", "make_scheduler"]
