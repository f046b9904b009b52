"""Inductor's compile-worker pool is stopped once loading is over (kiln/compile_workers.py): run in a fresh
interpreter, so that the pool and its processes are this test's alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys, time
    from kiln.compile_workers import stop_compile_workers
    assert not stop_compile_workers() and "torch" not in sys.modules  # nothing to stop, torch left unimported

    import psutil
    from torch._inductor.async_compile import AsyncCompile
    me = psutil.Process()
    # A pool up and idle, as after a load (the first compile of a process starts it; on a 2-core machine a CPU
    # compile runs without it).
    assert AsyncCompile.process_pool().submit(AsyncCompile._get_ready).result(timeout=120) == "ready"
    started = len(me.children(recursive=True))
    assert started >= 1, started
    assert stop_compile_workers()
    assert me.children(recursive=True) == [], me.children(recursive=True)
    assert AsyncCompile.process_pool.cache_info().currsize == 0  # a later compile starts a fresh pool
    print("ok", started)
""")


def test_the_pool_and_its_processes_are_stopped_and_a_later_compile_gets_a_fresh_one() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok"), done.stdout
