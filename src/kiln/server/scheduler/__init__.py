"""Schedulers decide when and on which instance a model's requests run."""

from kiln.server.scheduler.direct import DirectScheduler

__all__ = ["DirectScheduler"]
