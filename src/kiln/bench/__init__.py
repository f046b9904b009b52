"""kiln bench: throughput, latency percentiles, the server-side time breakdown and memory of one model, measured
direct (in this process), in-process through kiln.Server, or over HTTP / gRPC against any KServe V2 server.

    from kiln.bench import BenchOptions, run

    result = run(BenchOptions(model="simple", target="inprocess", model_repository=repo, concurrency=(1, 4)))
    print(result.to_json())

See docs/bench.md for the method (windows, stability, what each figure measures).
"""

from __future__ import annotations

from kiln.bench.options import BenchOptions
from kiln.bench.result import BenchResult, ClientTimesMs, Latency, LevelResult, ServerTimesUs
from kiln.bench.runner import run

__all__ = ["BenchOptions", "BenchResult", "ClientTimesMs", "Latency", "LevelResult", "ServerTimesUs", "run"]
