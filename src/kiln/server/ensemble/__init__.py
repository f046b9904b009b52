"""Ensembles: a model made of steps that call other models (Triton's ensemble_scheduling)."""

from kiln.server.ensemble.binding import SpecLookup, bind_ensemble
from kiln.server.ensemble.plan import LATEST, EnsemblePlan, Step, plan_ensemble
from kiln.server.ensemble.scheduler import EnsembleScheduler, StepDispatch, StepStats

__all__ = ["LATEST", "EnsemblePlan", "EnsembleScheduler", "SpecLookup", "Step", "StepDispatch", "StepStats",
           "bind_ensemble", "plan_ensemble"]
