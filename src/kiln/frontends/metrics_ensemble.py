"""kiln's per-step ensemble metrics: how often each step of an ensemble ran, failed, and how long it took.

Each step's model also counts these requests under its own nv_inference_* series; these say which ensemble and
which step they came from."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import Metric

from kiln.errors import KilnError
from kiln.server.ensemble import StepStats
from kiln.server.server import Server

_LABELS = ("model", "version", "step", "step_model")


def ensemble_step_families(server: Server) -> Iterator[Metric]:
    rows = list(_step_rows(server))
    families: tuple[tuple[str, str, Callable[[StepStats], int]], ...] = (
        ("kiln_ensemble_step_success", "Number of successful step requests per ensemble step",
         lambda s: s.success.count),
        ("kiln_ensemble_step_failure", "Number of failed step requests per ensemble step", lambda s: s.fail.count),
        ("kiln_ensemble_step_duration_us", "Cumulative step request duration in microseconds, failed ones too",
         lambda s: (s.success.ns + s.fail.ns) // 1000),
    )
    for name, help_text, read in families:
        family = Metric(name, help_text, "counter")
        for model, version, step in rows:
            family.add_sample(name, dict(zip(_LABELS, (model, version, str(step.index), step.model_name),
                                             strict=True)), read(step))
        yield family


def _step_rows(server: Server) -> Iterator[tuple[str, str, StepStats]]:
    for stats in server.model_statistics():
        try:
            if server.model_config(stats.name).platform != "ensemble":
                continue
            steps = server.ensemble_step_statistics(stats.name, stats.version)
        except KilnError:  # unloaded between the two calls, or not ready: nothing to report for it now
            continue
        for step in steps:
            yield stats.name, stats.version, step
