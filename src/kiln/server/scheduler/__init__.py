"""Schedulers decide when and on which instance a model's requests run."""

from kiln.errors import UnsupportedError
from kiln.server.model import LoadedModel
from kiln.server.scheduler.base import Scheduler
from kiln.server.scheduler.direct import DirectScheduler
from kiln.server.scheduler.dynamic import DynamicBatcher
from kiln.server.scheduler.policy import BatchingPolicy


def make_scheduler(model: LoadedModel) -> Scheduler:
    """The dynamic batcher when the config asks for dynamic_batching, else one request at a time per instance."""
    choice = model.spec.config.WhichOneof("scheduling_choice")
    if choice in ("sequence_batching", "ensemble_scheduling"):
        raise UnsupportedError(f"model '{model.name}': {choice} is not supported by this kiln version; "
                               f"use dynamic_batching or no scheduler")
    if choice == "dynamic_batching":
        return DynamicBatcher(model, BatchingPolicy.from_config(model.spec.config))
    return DirectScheduler(model)


__all__ = ["BatchingPolicy", "DirectScheduler", "DynamicBatcher", "Scheduler", "make_scheduler"]
