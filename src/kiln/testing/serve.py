"""`kiln serve` as a subprocess for tests and benchmarks: the helpers of :mod:`kiln.serve_process`."""

from kiln.serve_process import KilnProcess, free_port, kiln_serve, stop, wait_ready

__all__ = ["KilnProcess", "free_port", "kiln_serve", "stop", "wait_ready"]
